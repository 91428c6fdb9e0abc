"""One Slurm job, as data: `JobSpec`, validated once when it is made (a `UserError` names
the flag and the fix), so that nothing refused can reach a script. `#SBATCH` lines are not
shell, so values that would break them are refused here rather than escaped. What the job
becomes, the batch script and submitit's parameters, is job_script.py. Pure: no torch, no
subprocess.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from enn_cluster.cluster import pyxis

# the tests read time_minutes and _NAME from here too
from enn_cluster.cluster.slurm_values import (
    _NAME,
    MAX_CPUS_PER_TASK,
    MAX_GPUS_PER_NODE,
    _fail,
    _int,
    check_gpu_request,
    check_mem_gb,
    check_line,
    check_srun_arg,
    check_word,
    parse_sbatch_arg,
    time_minutes,
)
from enn_cluster.config import nccl
from enn_cluster.config.checks import MAX_NODES, node_range
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.config.launch_shape import LaunchShape

TASKS = ("train", "predict")
WORKER_MODULE = "enn_cluster.worker"
# Failure retries when nobody chose: the same for the CLI (parallel.max_restarts) and the
# admin templates (ENN_MAX_RESTARTS); tests pin all three together.
DEFAULT_MAX_RESTARTS = 0


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything one job needs; lists become tuples and 'none' image becomes None."""

    job_name: str
    run_dir: str
    task: str = "train"
    predict_name: Optional[str] = None
    nodes: Union[int, str] = 1  # N, or "MIN-MAX" for an elastic allocation
    gpus_per_node: int = 1  # one task per GPU
    gpu_request: str = "gpus-per-node"  # or gres / gres:TYPE (site.gpu_request)
    procs_per_node: int = 1  # tasks per node when gpus_per_node == 0 (CPU runs)
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None  # 0: all of each node's memory (--mem=0)
    time: Union[int, str] = 60  # minutes, or a Slurm time string
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    exclusive: bool = False
    wckey: Optional[str] = None  # site.wckey; None: no --wckey (not submitit's "submitit")
    signal_grace_s: int = 90
    container_image: Optional[str] = None  # squashfs path or registry ref; None: bare metal
    container_mounts: tuple[str, ...] = ()
    container_workdir: Optional[str] = None
    container_env: tuple[str, ...] = nccl.CONTAINER_ENV_NAMES
    nccl_profile: str = "auto"
    env: Mapping[str, str] = field(default_factory=dict)  # extra task variables; kept as pairs
    python: str = "python3"
    setup_lines: tuple[str, ...] = ()
    extra_sbatch_args: tuple[str, ...] = ()
    extra_srun_args: tuple[str, ...] = ()
    max_restarts: int = DEFAULT_MAX_RESTARTS
    spare_nodes: int = 0  # asked beside `nodes`, idle until a lost node's place is theirs

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name in ("container_mounts", "container_env", "setup_lines",
                     "extra_sbatch_args", "extra_srun_args"):
            value = getattr(self, name)
            fix(name, (value,) if isinstance(value, str) else tuple(value or ()))
        lo, hi = node_range(self.nodes)
        fix("nodes", lo if lo == hi else f"{lo}-{hi}")
        if pyxis.is_bare_metal(self.container_image):
            fix("container_image", None)
        env = self.env
        if isinstance(env, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in env):
            env = dict(env)  # the pairs it keeps, as dataclasses.replace hands them back
        if not isinstance(env, Mapping):
            raise _fail("--env", f"{self.env!r} is not a mapping", "give NAME=VALUE pairs")
        fix("env", tuple(env.items()))
        _validate(self)

    @classmethod
    def for_shape(cls, shape: LaunchShape, **fields) -> "JobSpec":
        """The job of a launch shape: its node range, GPUs and procs per node."""
        return cls(nodes=shape.job_nodes, gpus_per_node=shape.gpus_per_node,
                   procs_per_node=shape.procs_per_node, **fields)

    @property
    def shape(self) -> LaunchShape:
        lo, hi = self.node_range
        return LaunchShape(lo, self.procs_per_node, self.gpus_per_node, hi)

    @property
    def time_minutes(self) -> int:
        return time_minutes(self.time)

    @property
    def node_range(self) -> tuple[int, int]:
        return node_range(self.nodes)

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node or self.procs_per_node

    @property
    def placed_by_shell(self) -> bool:
        """The batch shell, not sbatch, lays the tasks out (host_setup.sh): a node range
        (the world is what was granted) or spare nodes (held out of the step until a node
        is lost); a lost node is then relaunched around inside the job."""
        lo, hi = self.node_range
        return lo != hi or self.spare_nodes > 0

    @property
    def allocated_nodes(self) -> tuple[int, int]:
        """The node range asked of Slurm: the training nodes' and the spares."""
        lo, hi = self.node_range
        return lo + self.spare_nodes, hi + self.spare_nodes

    @property
    def mounts(self) -> tuple[pyxis.Mount, ...]:
        """User mounts, then the run directory at its own path (the worker reads it)."""
        return (*pyxis.parse_mounts(self.container_mounts, INPUTS["container_mounts"]),
                pyxis.Mount(self.run_dir, self.run_dir))

    @property
    def env_names(self) -> tuple[str, ...]:
        """--container-env: the spec's names plus the extra variables it exports."""
        return pyxis.check_env_names((*self.container_env, *(k for k, _ in self.env)))

    @property
    def worker_args(self) -> list[str]:
        args = ["-m", WORKER_MODULE, self.run_dir, "--task", self.task]
        return args + (["--name", self.predict_name] if self.task == "predict" else [])


def _validate(s: JobSpec) -> None:
    check_word(s.job_name, INPUTS["job_name"], _NAME)
    pyxis.check_path(s.run_dir, INPUTS["run_dir"], "run directory")
    if "%" in s.run_dir or posixpath.normpath(s.run_dir) != s.run_dir:
        raise _fail(INPUTS["run_dir"], f"{s.run_dir!r} has '%', '.', '..', '//' or a "
                    "trailing '/'", "give the plain absolute path ('%' is a log-name pattern "
                    "in Slurm)")
    if s.task not in TASKS:
        raise _fail("--task", f"{s.task!r} is not a task", "use train or predict")
    if s.task == "predict":
        if not s.predict_name:
            raise _fail(INPUTS["name"], "predict needs a prediction name", "pass --name NAME")
        check_word(s.predict_name, INPUTS["name"], _NAME)
    time_minutes(s.time)
    _int(s.gpus_per_node, INPUTS["gpus_per_node"], 0, MAX_GPUS_PER_NODE)
    check_gpu_request(s.gpu_request, "site.gpu_request")
    _int(s.procs_per_node, INPUTS["procs_per_node"], 1, MAX_GPUS_PER_NODE)
    if s.cpus_per_task is not None:
        _int(s.cpus_per_task, INPUTS["cpus_per_task"], 1, MAX_CPUS_PER_TASK)
    if s.mem_gb is not None:
        check_mem_gb(s.mem_gb)
    for flag in ("partition", "account", "qos"):
        check_word(getattr(s, flag), INPUTS[flag])
    check_word(s.wckey, "site.wckey")
    _int(s.signal_grace_s, INPUTS["signal_grace"], 1)
    _int(s.max_restarts, INPUTS["max_restarts"], 0)
    _int(s.spare_nodes, INPUTS["spare_nodes"], 0, MAX_NODES - s.node_range[1])
    if s.time_minutes * 60 <= s.signal_grace_s + 60:
        raise UserError("{value!r} leaves no run time before the USR2 warning ({grace} s "
                        "before the end; Slurm may send it 60 s early)", field=INPUTS["time"],
                        value=s.time, grace=s.signal_grace_s,
                        fix="give more than {least} minutes or a smaller {signal_grace}",
                        least=(s.signal_grace_s + 60) // 60 + 1,
                        signal_grace=INPUTS["signal_grace"])
    if not isinstance(s.exclusive, bool):
        raise _fail(INPUTS["exclusive"], f"{s.exclusive!r} is not true/false", "give a boolean")
    _validate_container(s)
    check_line(s.python, INPUTS["python"])
    if not s.python.strip():
        raise _fail(INPUTS["python"], "empty interpreter", "give python3 or a path")
    nccl.check_profile(s.nccl_profile, "--nccl-profile")
    for name, value in s.env:
        pyxis.check_env_names([name], "--env")
        if not isinstance(value, str) or "\0" in value:
            raise _fail("--env", f"{name}={value!r} is not a string", "give text values")
    for i, line in enumerate(s.setup_lines):
        check_line(line, f"setup_lines[{i}]")
    for i, arg in enumerate(s.extra_sbatch_args):
        parse_sbatch_arg(arg, f"--sbatch-arg[{i}]")
    for i, arg in enumerate(s.extra_srun_args):
        check_srun_arg(arg, f"--srun-arg[{i}]")


def _validate_container(s: JobSpec) -> None:
    if s.container_image is None:
        if s.container_mounts or s.container_workdir:
            raise _fail(INPUTS["container_mounts"], "mounts or workdir given without an image",
                        "pass --container-image, or drop them for bare metal")
        return
    pyxis.check_image(s.container_image)
    pyxis.parse_mounts(s.container_mounts, INPUTS["container_mounts"])
    if s.container_workdir is not None:
        pyxis.check_path(s.container_workdir, "--container-workdir")
    pyxis.check_env_names(s.container_env)
