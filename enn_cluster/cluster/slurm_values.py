"""Checks on single Slurm values (names, times, sbatch/srun arguments, lines bound for a
shell), each raising a UserError that names the flag and the fix. Shared by the job
spec and the site config. Pure.
"""
from __future__ import annotations

import re
from typing import Optional, Union

from enn_cluster.config.launch_options import WHOLE_NODE_GPUS  # noqa: F401 (tests read it here)
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError

# sbatch options JobSpec owns; extra_sbatch_args may not repeat them.
MANAGED_SBATCH = frozenset({
    "job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "mem",
    "time", "partition", "account", "qos", "exclusive", "signal", "requeue", "no-requeue",
    "open-mode", "output", "error", "wrap", "wckey"})
# real sbatch options that are also the start of a managed one (sbatch takes exact names first)
_EXACT_OPTIONS = frozenset({"gpus", "ntasks"})
MANAGED_SRUN = ("--container-", "--no-container-", "--output", "--error", "--kill-on-bad-exit")
# srun options that place the tasks: the step's nodes and task counts follow the job (spares,
# node ranges), and the (replicate, shard) mesh needs ranks laid out node by node (block)
PLACEMENT_SRUN = ("--distribution", "-m", "--nodes", "-N", "--nodelist", "-w", "--ntasks",
                  "-n")

MAX_TIME_MINUTES = 366 * 24 * 60
MAX_GPUS_PER_NODE = 1024  # no node has more; beyond it a value is a typo
MAX_CPUS_PER_TASK = 2**16
MAX_MEM_GB = 2**20  # 1 PiB per node
MIN_MEM_GB = 1 / 1024  # 1 MiB: below it sbatch gets --mem=0M, which Slurm reads as all memory

_NAME = re.compile(r"^\w[\w.+-]*\Z")  # job / prediction names (unicode letters allowed)
_SLURM_WORD = re.compile(r"^[\w.,+-]+\Z")  # partition, account, qos
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*\Z")
_SBATCH_UNSAFE = re.compile(r"[\s'\"\\#$`]|[\x00-\x1f\x7f]")
_TIME = re.compile(r"^(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?\Z")


def time_minutes(value: Union[int, str], field_name=INPUTS["time"]) -> int:
    """Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) or int -> minutes."""
    if isinstance(value, int) and not isinstance(value, bool):
        minutes = value
    elif isinstance(value, str) and len(value) <= 40 and _TIME.match(value.strip()):
        d, a, b, c = _TIME.match(value.strip()).groups()
        nums = [int(x) for x in (a, b, c) if x is not None]
        if d is not None:  # D-HH[:MM[:SS]]
            h, m, s = (nums + [0, 0])[:3]
            secs = ((int(d) * 24 + h) * 60 + m) * 60 + s
        elif len(nums) == 3:
            secs = (nums[0] * 60 + nums[1]) * 60 + nums[2]
        else:  # MM or MM:SS
            secs = nums[0] * 60 + (nums[1] if len(nums) == 2 else 0)
        minutes = -(-secs // 60)
    else:
        raise UserError.on(field_name, f"{short_value(value)} is not a time; give minutes (240) or a "
                                       "Slurm time like 04:00:00 or 1-12:00:00")
    if minutes <= 0:
        raise UserError.on(field_name, f"{short_value(value)} must be at least one minute")
    if minutes > MAX_TIME_MINUTES:
        raise UserError.on(field_name, f"{short_value(value)} is more than a year; give a real "
                                       "time limit (Slurm's own limits are far below it)")
    return minutes


def whole_node_request(gpus_per_node: int, whole_node_gpus: int, exclusive: bool,
                       mem_gb: Optional[float]) -> tuple[bool, Optional[float]]:
    """(exclusive, mem_gb) for a job: one that asks for every GPU of a node gets the node,
    --exclusive (its CPUs, memory bandwidth and NICs unshared; the batch script's CPUs per
    task are then the node's) and --mem=0 (all its memory: eight CUDA processes with
    pinned buffers under a site's DefMemPerCPU are killed by the memory cgroup). A memory
    size given stays; other jobs are as asked."""
    if whole_node_gpus and gpus_per_node >= whole_node_gpus:
        return True, 0 if mem_gb is None else mem_gb
    return exclusive, mem_gb


def _fail(flag, problem: str, fix: str) -> UserError:
    """`flag`: a launch option (config/inputs.py), named in each front end's words, or a
    site file's key."""
    return UserError.on(flag, problem, fix=fix)


def check_line(line: str, flag: str) -> str:
    if not isinstance(line, str) or "\n" in line or "\r" in line or "\0" in line:
        raise _fail(flag, f"{line!r} is not one line", "give one command or argument per item")
    return line


def parse_sbatch_arg(arg: str, flag: str = "--sbatch-arg") -> tuple[str, Union[str, bool]]:
    """'--key=value' or '--key' -> (key, value|True), safe on an #SBATCH line."""
    check_line(arg, flag)
    key, eq, value = arg.partition("=")
    key = key[2:] if key.startswith("--") else ""
    if not _SBATCH_KEY.match(key) or (eq and not value):
        raise _fail(flag, f"{arg!r} is not a long sbatch option",
                    "write --option=value, e.g. --constraint=a100")
    if key in MANAGED_SBATCH or (key not in _EXACT_OPTIONS and any(
            m.startswith(key) for m in MANAGED_SBATCH)):  # sbatch reads --out as --output
        raise _fail(flag, f"--{key} is set by enn_cluster", "use its own flag or site key")
    if _SBATCH_UNSAFE.search(value):
        raise _fail(flag, f"{arg!r} has spaces, quotes, '#', '$' or '\\'",
                    "#SBATCH lines cannot carry them; drop those characters")
    return key, (value if eq else True)


def check_srun_arg(arg: str, flag: str = "--srun-arg") -> str:
    check_line(arg, flag)
    if not arg.startswith("-"):
        raise _fail(flag, f"{arg!r} is not an option", "write --option=value (one item each)")
    if arg.startswith(MANAGED_SRUN):
        raise _fail(flag, f"{arg!r} is set by enn_cluster",
                    "use the container/image flags or site keys instead")
    if arg.startswith(PLACEMENT_SRUN):
        raise _fail(flag, f"{arg!r} is set by enn_cluster (tasks placed node by node, as the "
                          "job's nodes and --gpus-per-node say)",
                    "drop it; give --nodes and --gpus-per-node to enn-submit")
    return arg


def short_value(value) -> str:
    """A value for a message: an int too long to print (Python refuses past 4300 digits)
    by its size, anything else by repr cut to 40 characters."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"a number of {value.bit_length()} bits"
    return repr(value)[:40]


def _int(value, flag: str, lo: int, hi: int = 2**31 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _fail(flag, f"{short_value(value)} is not a whole number >= {lo}",
                    f"give one >= {lo}")
    if value > hi:
        raise _fail(flag, f"{short_value(value)} is more than {hi}", "give a real count")
    return value


def check_mem_gb(value, flag=INPUTS["mem_gb"]) -> None:
    """GB per node: 0 (all of it), or between 1 MiB and 1 PiB."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value == 0 or MIN_MEM_GB <= value <= MAX_MEM_GB):
        raise _fail(flag, f"{short_value(value)} is not a memory size",
                    f"give GB per node from {MIN_MEM_GB:.4f} to {MAX_MEM_GB}, or 0 for all")


def check_word(value: Optional[str], flag: str, pattern=_SLURM_WORD) -> Optional[str]:
    if value is not None and (not isinstance(value, str) or not pattern.match(value)):
        raise _fail(flag, f"{value!r} has characters an #SBATCH line cannot carry",
                    "use letters, digits and . _ - +")
    return value


_GPU_REQUEST = re.compile(r"^(?:gpus-per-node|gres(?::[A-Za-z0-9_.-]{1,64})?)\Z")


def check_gpu_request(value: str, flag: str) -> str:
    """How a job asks for GPUs: --gpus-per-node (select/cons_tres), or --gres=gpu[:TYPE]:N
    on sites whose select plugin has no GPU-per-node option."""
    if not isinstance(value, str) or not _GPU_REQUEST.match(value):
        raise _fail(flag, f"{value!r} is not a way to ask for GPUs",
                    "use gpus-per-node, gres or gres:TYPE (TYPE as in the site's gres.conf)")
    return value


def gpu_option(request: str, gpus: int) -> tuple[str, str]:
    """The (sbatch option, value) for `gpus` per node: ("gpus-per-node", "8") or
    ("gres", "gpu:a100:8")."""
    if request == "gpus-per-node":
        return "gpus-per-node", str(gpus)
    gpu_type = request.partition(":")[2]
    return "gres", f"gpu:{gpu_type}:{gpus}" if gpu_type else f"gpu:{gpus}"
