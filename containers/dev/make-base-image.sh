#!/usr/bin/env bash
# Make the local dev/test base image: Debian bookworm minbase + python3 (debootstrap, because
# no container registry is reachable from dev and CI machines) plus torch and the other
# runtime wheels of enn_cluster, so that an image built over it trains.
# Usage: make-base-image.sh CACHE_DIR        prints the base image's tag on its last line
# The tag is localhost/enn-testbase:KEY, KEY a hash of the rootfs tar, the wheels and this
# recipe: a second run finds the image (or the cached tar and wheels) and builds nothing.
# Build args for containers/Dockerfile over it: BASE_IMAGE=TAG and
#   PIP_INSTALL_FLAGS="--no-deps --no-index --no-build-isolation --break-system-packages"
# Needs root, debootstrap, podman and a pip that finds the torch wheel (local find-links).
set -euo pipefail

readonly cache_dir="${1:?usage: make-base-image.sh CACHE_DIR}"
readonly suite=bookworm
readonly packages=python3,python3-pip,ca-certificates
readonly tarball="${cache_dir}/enn-testbase-${suite}.tar"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly repo_root
readonly recipe="${repo_root}/containers/dev/Dockerfile.testbase"
# The runtime requirements of pyproject.toml and its llm extra, torch pinned by
# constraints-dev.txt.
readonly requirements=(torch submitit pyyaml numpy fsspec xxhash tqdm
                       transformers peft tokenizers pyarrow safetensors)

# crun fails on this kind of host; our containers.conf selects runc (see the notes).
if [[ -z "${CONTAINERS_CONF:-}" ]] && command -v runc >/dev/null 2>&1; then
    export CONTAINERS_CONF="${repo_root}/containers/containers.conf"
fi

log() { echo "make-base-image: $*" >&2; }

# First Debian mirror that serves $suite, from one-line or deb822 apt sources.
debian_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
    local existing=() f
    for f in "${files[@]}"; do
        [[ -f "$f" ]] && existing+=("$f")
    done
    local mirror=""
    if [[ "${#existing[@]}" -gt 0 ]]; then
        mirror="$(awk -v suite="$suite" '
            /^deb[ \t]/ { for (i = 2; i < NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/ && $i ~ /:\/\//) {
                              if ($(i + 1) == suite) { print $i; exit } else break } }
            /^URIs:/    { uris = $2 }
            /^Suites:/  { for (i = 2; i <= NF; i++) if ($i == suite && uris != "") { print uris; exit } }
            /^[ \t]*$/  { uris = "" }
        ' "${existing[@]}")"
    fi
    echo "${mirror:-http://deb.debian.org/debian}"
}

make_tarball() {
    local mirror rootfs
    mirror="$(debian_mirror)"
    rootfs="$(mktemp -d "${cache_dir}/rootfs.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: $rootfs is local to this function
    trap "rm -rf '${rootfs}' '${tarball}.tmp'" EXIT
    log "debootstrap ${suite} from ${mirror}"
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >/dev/null
    # Caches and docs only slow down every import, build and export of the image.
    rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* \
        "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/locale/*
    tar -C "$rootfs" --numeric-owner -cf "${tarball}.tmp" .
    mv "${tarball}.tmp" "$tarball"
    rm -rf "$rootfs"
    trap - EXIT
}

# Wheels for Debian's python3 (cp311, like this host's); pip resolves torch from local disk.
download_wheels() {
    local dir="$1" want="requirements: ${requirements[*]}"
    # the marker names what was asked for: a changed list downloads again
    if [[ -s "$dir/.complete" && "$(head -n 1 "$dir/.complete")" == "$want" ]]; then return 0; fi
    rm -rf "$dir" && mkdir -p "$dir"
    log "pip download ${requirements[*]} into $dir"
    python3 -m pip download -q --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
        -c "${repo_root}/constraints-dev.txt" -d "$dir" "${requirements[@]}" >&2
    compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null \
        || { log "pip found no CPU torch wheel (a CUDA build is too big): $(ls "$dir")"; exit 1; }
    (echo "$want" && cd "$dir" && ls -- *.whl) >"$dir/.complete.tmp"
    mv "$dir/.complete.tmp" "$dir/.complete"
}

mkdir -p "$cache_dir"
[[ -s "$tarball" ]] || make_tarball
wheels="${cache_dir}/wheels"
download_wheels "$wheels"
# Name, size and time of the tar stand for its content (hashing 130 MB would take a second).
key="$({ stat -c '%n %s %Y' "$tarball"; cat "$wheels/.complete" "$recipe" "${BASH_SOURCE[0]}"; } \
    | sha256sum | cut -c1-16)"
readonly debian_tag="localhost/enn-debian:${suite}-${key}" tag="localhost/enn-testbase:${key}"

if podman image exists "$tag"; then
    log "${tag} already exists"
    echo "$tag"
    exit 0
fi
if ! podman image exists "$debian_tag"; then
    podman import --quiet "$tarball" "$debian_tag" >/dev/null
fi
log "installing the wheels into ${tag}"
podman build -q --build-arg "DEBIAN_IMAGE=${debian_tag}" -f "$recipe" -t "$tag" "$wheels" >&2
podman rmi "$debian_tag" >/dev/null 2>&1 || true
log "built ${tag}"
echo "$tag"
