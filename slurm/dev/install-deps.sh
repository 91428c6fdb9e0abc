#!/usr/bin/env bash
# Install the system packages the tests and demos need (Slurm, munge, shellcheck, podman and
# squashfs tools). Called by `make test` on every run, so the all-installed path is a single
# dpkg-query and no network. Only acts as root with apt-get; otherwise it says so and exits 0.
set -euo pipefail

readonly PACKAGES=(
    slurmctld slurmd slurm-client munge    # the local dev cluster (slurm/dev/cluster.sh)
    iproute2                               # bridge, veth and network namespaces for its nodes
    shellcheck                             # lints slurm/dev/*.sh and the rendered scripts
    podman buildah runc uidmap fuse-overlayfs debootstrap  # container image builds
    squashfs-tools squashfuse              # squashfs images for Enroot/Pyxis
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

mapfile -t missing < <(missing_packages)
if [[ "${#missing[@]}" == 0 ]]; then
    exit 0
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Another apt run (a background install, a second `make test`) may hold the dpkg lock: wait.
readonly APT_OPTS=(-o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
apt-get "${APT_OPTS[@]}" update -qq
apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
