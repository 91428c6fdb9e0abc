#!/usr/bin/env bash
# Make the local test base image (Debian bookworm minbase + python3, pip, CA certificates)
# with debootstrap, because no container registry is reachable from dev and CI machines.
# Usage: make-base-image.sh CACHE_DIR [TAG]   (TAG defaults to localhost/enn-testbase:latest)
# The rootfs tar is kept in CACHE_DIR so a second run only does `podman import`; the script
# does nothing when TAG already exists. Needs root, debootstrap and podman.
set -euo pipefail

readonly cache_dir="${1:?usage: make-base-image.sh CACHE_DIR [TAG]}"
readonly tag="${2:-localhost/enn-testbase:latest}"
readonly suite=bookworm
readonly packages=python3,python3-pip,ca-certificates
readonly tarball="${cache_dir}/enn-testbase-${suite}.tar"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly repo_root

# crun fails on this kind of host; our containers.conf selects runc (see the notes).
if [[ -z "${CONTAINERS_CONF:-}" ]] && command -v runc >/dev/null 2>&1; then
    export CONTAINERS_CONF="${repo_root}/containers/containers.conf"
fi

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
    mkdir -p "$cache_dir"
    rootfs="$(mktemp -d "${cache_dir}/rootfs.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: $rootfs is local to this function
    trap "rm -rf '${rootfs}' '${tarball}.tmp'" EXIT
    echo "make-base-image: debootstrap ${suite} from ${mirror}"
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >/dev/null
    # Caches and docs only slow down every import, build and export of the image.
    rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* \
        "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/locale/*
    tar -C "$rootfs" --numeric-owner -cf "${tarball}.tmp" .
    mv "${tarball}.tmp" "$tarball"
}

if podman image exists "$tag"; then
    echo "make-base-image: ${tag} already exists"
    exit 0
fi
if [[ ! -s "$tarball" ]]; then
    make_tarball
fi
podman import --quiet "$tarball" "$tag" >/dev/null
echo "make-base-image: imported ${tag} from ${tarball}"
