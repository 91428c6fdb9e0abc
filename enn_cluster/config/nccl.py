"""NCCL and libfabric settings per network fabric: AWS EFA, InfiniBand, or plain sockets.

Why here: the right variables differ per fabric and a wrong one (EFA's fork-safety
hugepages, IB timeouts) fails only at scale. Detection reads sysfs under a root passed in,
so tests feed fake trees; `nccl_env` is pure and never overrides a variable the user set.
The worker calls `configure` on the node (inside the container, where the image's NCCL
plugin is what matters); rendered scripts export the static part via `script_env`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping, Optional, Sequence

from enn_cluster.errors import UserError, did_you_mean

PROFILES = ("auto", "efa", "ib", "socket", "none")
FABRICS = ("efa", "ib", "socket")
PROFILE_VAR = "ENN_NCCL_PROFILE"  # the profile a job asks for (worker reads it)
FABRIC_VAR = "ENN_FABRIC"  # overrides detection on a node (efa|ib|socket)

DEFAULT_LIBFABRIC_PATHS = ("/opt/amazon/efa",)
# No profile sets NCCL_SOCKET_IFNAME: control_net names one interface (the site's, or the
# route to MASTER_ADDR) before the profile is applied; with neither, NCCL chooses itself,
# skipping lo and docker* and preferring ib*
# (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname),
# where an exclusion list bypasses that preference and can land on a storage or BMC NIC.

COMMON_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # tear down on a collective error, no hang
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # flight-recorder dump explains which rank hung
    "TORCH_FR_BUFFER_SIZE": "20000",
}
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": "0",
    "FI_EFA_USE_HUGE_PAGE": "0",  # hugepages make fork() fail with ENOMEM (data loaders)
}
# NCCL_IB_RETRY_CNT is a 3-bit verbs field: 7 is the maximum (and NCCL's default); mlx5
# masks larger values (14 became 6). NCCL_IB_TIMEOUT is 5 bits: 4.096 us * 2^value.
IB_ENV = {"NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7"}
SOCKET_ENV = {"NCCL_IB_DISABLE": "1"}

# Documented range of every closed-domain value we set: (low, high) for integers, or the
# set of accepted words; `report` judges the job's effective values against it. Names,
# paths and lists (interfaces, plugin, dump files) are not judged here.
# tests/config/test_nccl_ranges.py holds the whole table with its references.
RANGES: dict[str, object] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (0, 3), "TORCH_NCCL_DUMP_ON_TIMEOUT": (0, 1),
    "TORCH_FR_BUFFER_SIZE": (0, 2**31 - 1), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": (1, 2**31 - 1),
    "FI_PROVIDER": {"efa"}, "FI_EFA_USE_DEVICE_RDMA": (0, 1),
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": (0, 1), "FI_EFA_USE_HUGE_PAGE": (0, 1),
    "NCCL_IB_TIMEOUT": (1, 31), "NCCL_IB_RETRY_CNT": (0, 7), "NCCL_IB_DISABLE": (0, 1),
    "NCCL_DEBUG": {"VERSION", "WARN", "INFO", "TRACE"},
}


def heartbeat_env(timeout_s: float) -> dict[str, str]:
    """NCCL's heartbeat monitor kills a process whose watchdog thread is silent for
    TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (torch's default: 480 s). It must outlast the lanes'
    collective timeout (parallel.timeout_s), or a long collective that our timeout allows
    would be killed first, without the evidence our failure path leaves."""
    return {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(480, int(timeout_s) + 120))}


def out_of_range(values: Mapping[str, str]) -> list[str]:
    """'NAME=value (range)' for each value outside its documented range. Words compare
    case-insensitively, as NCCL reads them (src/debug.cc: strcasecmp on NCCL_DEBUG)."""
    bad = []
    for name, value in values.items():
        allowed = RANGES.get(name)
        if isinstance(allowed, tuple):
            ok = value.strip().isdigit() and allowed[0] <= int(value) <= allowed[1]
            if not ok:
                bad.append(f"{name}={value} (expected {allowed[0]}..{allowed[1]})")
        elif isinstance(allowed, set) and value.casefold() not in {w.casefold() for w in allowed}:
            bad.append(f"{name}={value} (expected {' or '.join(sorted(allowed))})")
    return bad


NCCL_ENV_NAMES = tuple(sorted(
    {*COMMON_ENV, *EFA_ENV, *IB_ENV, *SOCKET_ENV, "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"}))
# Names Pyxis should take from the host (--container-env). Not LD_LIBRARY_PATH: Pyxis
# would replace the image's whole value with the host's; the worker sets it at exec inside
# the container (exec_env). Unset names are skipped by Pyxis.
CONTAINER_ENV_NAMES = tuple(sorted(
    {*NCCL_ENV_NAMES, PROFILE_VAR, FABRIC_VAR, "MASTER_ADDR", "MASTER_PORT",
     "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_NET_PLUGIN", "ENN_NCCL_PLUGIN_DIRS",
     "GLOO_SOCKET_IFNAME", "ENN_SOCKET_IFNAME"}))


@dataclass(frozen=True)
class Interfaces:
    """What one node offers: RDMA devices by kind, network interfaces, libfabric."""

    efa_devices: tuple[str, ...] = ()
    ib_devices: tuple[str, ...] = ()  # verbs devices that are not EFA (mlx5_*, ...)
    ib_hca: tuple[str, ...] = ()  # DEV:PORT of ACTIVE InfiniBand ports near a GPU (NCCL_IB_HCA)
    net: tuple[str, ...] = ()
    libfabric: bool = False

    @property
    def fabric(self) -> str:
        if self.efa_devices:
            return "efa"
        return "ib" if self.ib_devices else "socket"


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _listdir(path: Path) -> list[str]:
    try:
        return sorted((p.name for p in path.iterdir()), key=_natural_key)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _is_efa(dev: Path, libfabric: bool) -> bool:
    """EFA devices are named rdmap*/efa*, or their driver is `efa`. On a host with the
    EFA software, a non-Mellanox device whose driver is unreadable counts as EFA too."""
    if dev.name.startswith(("rdmap", "efa")):
        return True
    link = dev / "device" / "driver"
    driver = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    if driver == "efa":
        return True
    return libfabric and driver is None and not dev.name.startswith("mlx")


def active_ib_ports(dev: Path) -> list[str]:
    """`DEV:PORT` for each port of a verbs device whose link layer is InfiniBand and whose
    state is ACTIVE (ports/N/link_layer, ports/N/state "4: ACTIVE"): not RoCE (Ethernet)
    ports, not ports that are down, so NCCL_IB_HCA never names a port NCCL cannot use."""
    ports = []
    for port in _listdir(dev / "ports"):
        try:
            layer = (dev / "ports" / port / "link_layer").read_text().strip()
            state = (dev / "ports" / port / "state").read_text().strip()
        except OSError:
            continue
        if layer == "InfiniBand" and state.split(":")[-1].strip() == "ACTIVE":
            ports.append(f"{dev.name}:{port}")
    return ports


PCI_FUNCTION = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
NVIDIA_VENDOR = "0x10de"


def pci_path(device: Path) -> tuple[str, ...]:
    """The PCI functions from the root port down to a sysfs device (the resolved path's
    `DDDD:BB:DD.F` parts): two devices with the same first one sit under one root port."""
    return tuple(p for p in Path(os.path.realpath(device)).parts if PCI_FUNCTION.fullmatch(p))


def gpu_pci_paths(root: Path) -> list[tuple[str, ...]]:
    """The PCI paths of the node's NVIDIA GPUs (vendor 0x10de, a display class 0x03...),
    from sysfs alone: the NCCL environment is set before CUDA starts."""
    out = []
    for name in _listdir(root / "bus" / "pci" / "devices"):
        dev = root / "bus" / "pci" / "devices" / name
        try:
            vendor, cls = ((dev / f).read_text().strip() for f in ("vendor", "class"))
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and cls.startswith("0x03") and pci_path(dev):
            out.append(pci_path(dev))
    return out


def near_gpu_ports(root: Path, ports: Sequence[str]) -> tuple[str, ...]:
    """The InfiniBand ports whose device shares a PCIe root port with a GPU: the GPUs'
    rails, without the storage HCAs that DGX-style nodes hang off switches of their own.
    All of `ports` when sysfs shows no GPU or no port near one (nothing is dropped that
    NCCL could need)."""
    gpus = {path[0] for path in gpu_pci_paths(root)}
    near = [port for port in ports
            if (pci_path(root / "class" / "infiniband" / port.split(":")[0] / "device")
                or ("",))[0] in gpus]
    return tuple(near) or tuple(ports)


def scan_interfaces(sysfs_root: str = "/sys",
                    libfabric_paths: Sequence[str] = DEFAULT_LIBFABRIC_PATHS,
                    dev_root: str = "/dev") -> Interfaces:
    """Read /sys/class/infiniband and /sys/class/net under `sysfs_root`. Enroot's Mellanox
    hook hides non-mlx devices from /sys/class/infiniband; with no device listed there, the
    EFA driver loaded (/sys/module/efa) and verbs devices in /dev/infiniband mean EFA."""
    root = Path(sysfs_root)
    libfabric = any(Path(p).exists() for p in libfabric_paths)
    efa, ib = [], []
    for name in _listdir(root / "class" / "infiniband"):
        (efa if _is_efa(root / "class" / "infiniband" / name, libfabric) else ib).append(name)
    if not efa and not ib and _efa_driver(root):
        efa = [n for n in _listdir(Path(dev_root) / "infiniband") if n.startswith("uverbs")]
    net = tuple(_listdir(root / "class" / "net"))
    hca = [p for name in ib for p in active_ib_ports(root / "class" / "infiniband" / name)]
    return Interfaces(tuple(efa), tuple(ib), near_gpu_ports(root, hca), net, libfabric)


def _efa_driver(root: Path) -> bool:
    return (root / "module" / "efa").is_dir() or (root / "bus" / "pci" / "drivers" / "efa").is_dir()


def _fabric_override(environ: Mapping[str, str]) -> Optional[str]:
    value = environ.get(FABRIC_VAR, "").strip().lower()
    if not value:
        return None
    if value not in FABRICS:
        raise UserError(f"{FABRIC_VAR}={environ[FABRIC_VAR]!r} is not a fabric; "
                        f"use one of {', '.join(FABRICS)} or unset it to detect")
    return value


def detect_fabric(sysfs_root: str = "/sys", environ: Optional[Mapping[str, str]] = None,
                  libfabric_paths: Sequence[str] = DEFAULT_LIBFABRIC_PATHS) -> str:
    """'efa' | 'ib' | 'socket' for this node; $ENN_FABRIC in `environ` wins."""
    override = _fabric_override(environ or {})
    return override or scan_interfaces(sysfs_root, libfabric_paths).fabric


def check_profile(profile: str, field: str = "nccl_profile") -> str:
    if profile not in PROFILES:
        raise UserError(f"{field}: {profile!r} is not an NCCL profile; "
                        f"use one of {', '.join(PROFILES)}{did_you_mean(profile, PROFILES)}")
    return profile


def _profile_values(fabric: str, interfaces: Optional[Interfaces]) -> dict[str, str]:
    values = dict(COMMON_ENV)
    if fabric == "efa":
        values.update(EFA_ENV)
    elif fabric == "ib":
        values.update(IB_ENV)
        if interfaces and interfaces.ib_hca:  # none ACTIVE: unset, NCCL chooses
            values["NCCL_IB_HCA"] = "=" + ",".join(interfaces.ib_hca)  # '=': exact names
    else:
        values.update(SOCKET_ENV)
    return values


def nccl_env(profile: str, environ: Optional[Mapping[str, str]] = None,
             interfaces: Optional[Interfaces] = None) -> dict[str, str]:
    """The profile's variables that `environ` does not set yet (LD_LIBRARY_PATH is set at
    exec, by exec_env, not here). 'auto' resolves through the given interfaces, else `detect_fabric`."""
    environ = {} if environ is None else environ
    check_profile(profile)
    if profile == "none":
        return {}
    fabric = profile
    if profile == "auto":
        fabric = _fabric_override(environ) or (interfaces.fabric if interfaces
                                               else detect_fabric(environ=environ))
    values = _profile_values(fabric, interfaces)
    return {k: v for k, v in values.items() if k not in environ}


def script_env(profile: str) -> dict[str, str]:
    """What a batch script exports for `profile`, decided without looking at any node:
    'auto' leaves the fabric to the worker (it detects on the node) and exports only the
    fabric-independent part; NCCL_IB_HCA is left to the node for the same reason."""
    check_profile(profile)
    if profile == "none":
        return {}
    if profile == "auto":
        return dict(COMMON_ENV)
    return nccl_env(profile, {}, Interfaces())


FR_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # new, old name
REPORTED_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_SOCKET_IFNAME")


def flight_recorder_env(log_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Flight-recorder dumps under the attempt's log directory (torch appends the rank),
    not the container's /tmp, which vanishes with the container."""
    prefix = f"{log_dir}/nccl-trace-rank-"
    return {name: prefix for name in FR_FILE_VARS if name not in environ}


MEMLOCK_ENOUGH = 1 << 40  # bytes a task may lock: above this counts as unlimited


def memlock_problem(fabric: str, soft_limit: Optional[int]) -> Optional[str]:
    """NCCL over InfiniBand or EFA registers its buffers with the NIC, which pins them:
    a task whose `ulimit -l` is a login node's 64 KiB (Slurm propagates the submitting
    shell's limits by default) fails inside NCCL at the first collective. None: fine
    (`soft_limit` None is unlimited)."""
    if fabric not in ("ib", "efa") or soft_limit is None or soft_limit >= MEMLOCK_ENOUGH:
        return None
    return (f"ulimit -l: this task may lock {soft_limit // 1024} KiB of memory, and NCCL over "
            f"{fabric} pins its buffers for RDMA (it needs unlimited); submit from a shell "
            "with `ulimit -l unlimited`, or have Slurm keep the node's limit "
            "(PropagateResourceLimitsExcept=MEMLOCK in slurm.conf, or srun --propagate=NONE "
            "in a site's own script)")


def report(environ: Mapping[str, str], fabric: str) -> list[tuple[str, str]]:
    """(level, line) pairs for the log: the effective NCCL/FI/flight-recorder values, a
    warning for each value that differs from the fabric's profile (the image's ENV or the
    job's environment won), and one for each value outside its documented range."""
    effective = {k: v for k, v in sorted(environ.items()) if k.startswith(REPORTED_PREFIXES)}
    lines = [("info", f"NCCL environment ({fabric}): " +
              (" ".join(f"{k}={v}" for k, v in effective.items()) or "(none set)"))]
    profile = _profile_values(fabric, None) if fabric in FABRICS else {}
    for name, wanted in profile.items():  # without interfaces: nothing node-specific
        if environ.get(name, wanted) != wanted:
            lines.append(("warning", f"{name}={environ[name]} differs from the {fabric} "
                          f"profile's {wanted}: a value already set (the image's ENV, or the "
                          "job's) wins; unset it in the image or pass it with --container-env"))
    lines += [("warning", f"out of its documented range: {bad}")
              for bad in out_of_range(effective)]
    return lines


def configure(environ: MutableMapping[str, str], profile: Optional[str] = None,
              sysfs_root: str = "/sys",
              libfabric_paths: Sequence[str] = DEFAULT_LIBFABRIC_PATHS) -> str:
    """Apply the profile to `environ` on this node (the worker, before NCCL starts);
    returns the fabric chosen ('none' when the profile is none)."""
    profile = check_profile(profile or environ.get(PROFILE_VAR) or "auto", PROFILE_VAR)
    if profile == "none":
        return "none"
    interfaces = scan_interfaces(sysfs_root, libfabric_paths)
    fabric = profile
    if profile == "auto":
        fabric = _fabric_override(environ) or interfaces.fabric
    environ.update(nccl_env(fabric, environ, interfaces))
    return fabric
