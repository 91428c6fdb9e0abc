#!/usr/bin/env bash
# Install the system packages the tests and demos need (Slurm, munge, shellcheck, podman and
# squashfs tools), then real Enroot + Pyxis from $PYXIS_ENROOT_SRC (default
# ../shared/tools/pyxis-enroot beside the checkout) where that
# directory exists (its install.sh builds once and caches; without it the Pyxis tests skip).
# Called by `make test` on every run, so the all-installed path is a single dpkg-query, a
# cached install.sh (under a second) and no network. Only acts as root with apt-get;
# otherwise it says so and exits 0.
set -euo pipefail

readonly PACKAGES=(
    slurmctld slurmd slurm-client munge    # the local dev cluster (slurm/dev/cluster.sh)
    iproute2                               # bridge, veth and network namespaces for its nodes
    shellcheck                             # lints slurm/dev/*.sh and the rendered scripts
    podman buildah runc uidmap fuse-overlayfs debootstrap  # container image builds
    squashfs-tools squashfuse              # squashfs images for Enroot/Pyxis
    strace                                 # the syscalls a checkpoint write makes (tests, bench)
)

if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1 \
        || ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-deps: skipped (needs root and apt-get); tests that need these packages will skip"
    exit 0
fi

# Packages not fully installed ("ii"); unknown packages make dpkg-query print nothing for them.
missing_packages() {
    local installed
    installed="$(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' "${PACKAGES[@]}" 2>/dev/null \
        | awk '$1 == "ii" { print $2 }' || true)"
    local pkg
    for pkg in "${PACKAGES[@]}"; do
        if ! grep -Fx -- "$pkg" <<<"$installed" >/dev/null; then
            echo "$pkg"
        fi
    done
}

install_packages() {
    local missing
    mapfile -t missing < <(missing_packages)
    [[ "${#missing[@]}" != 0 ]] || return 0
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Another apt run (a background install, a second `make test`) may hold the dpkg lock: wait.
    local apt_opts=(-o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
    apt-get "${apt_opts[@]}" update -qq
    apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "${missing[@]}"
    echo "install-deps: done"
}

# Enroot + Pyxis from the shared tools beside the checkout, or from $PYXIS_ENROOT_SRC (a
# folder holding install.sh); its log only when it fails.
install_pyxis_enroot() {
    local repo_root src script log
    repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    src="${PYXIS_ENROOT_SRC:-$repo_root/../shared/tools/pyxis-enroot}"
    script="$src/install.sh"
    if [[ ! -f "$script" ]]; then
        echo "install-deps: no $script (the Pyxis/Enroot sources): Pyxis/Enroot tests will" \
            "skip; give their folder with make system-deps PYXIS_ENROOT_SRC=DIR"
        return 0
    fi
    log="$(mktemp)"
    if ! bash "$script" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "install-deps: error: $script failed" >&2
        return 1
    fi
    grep -F 'built enroot' "$log" || true
    rm -f "$log"
}

install_packages
install_pyxis_enroot
