"""The launch options, one row each: the CLI's flag, the API's `cluster=` key, the site
file's key and the JobSpec field of one value, its type, default and help.

Everything else reads this table: the launch flags of `enn-submit train/prepare/resume/
predict/render` (client/cli.py), the keys the API's `cluster=` takes (client/api.py), what
reaches Slurm (SlurmRequest and build_spec, cluster/submit_slurm.py), the site file's keys,
typing and defaults (cluster/site.py) and each front end's name of an option in errors
(config/inputs.py). Adding an option is one row (tests/config/test_launch_options.py copies
the package, adds a row and follows it end to end); what the value then does in the job
is the JobSpec's (cluster/job_spec.py: its field, its check; cluster/job_script.py: its
#SBATCH line).

A value given on the command line or in `cluster=` wins over the site file's, which wins
over the default (site.merge). Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# A job asking for at least this many GPUs per node takes whole nodes (site.whole_node_gpus;
# 8: DGX/HGX H100, AWS p4d/p5; 0 turns the rule off): cluster/slurm_values.whole_node_request.
WHOLE_NODE_GPUS = 8


@dataclass(frozen=True)
class Kind:
    """A value's type: what a site file must hold, how the CLI reads the flag, and how a
    front end's value is handed on."""

    name: str
    expected: str  # the site file's error: "expected <this>, got ..."
    holds: Callable[[Any], bool]  # a site file's (YAML) value is of this type
    flag: Mapping[str, Any] = field(default_factory=dict)  # argparse keywords of its flag
    normal: Callable[[Any], Any] = lambda value: value  # a flag's or `cluster=` value, handed on
    shown: Callable[[Any], str] = repr  # a wrong value, in the site file's error
    fix: str = ""  # the site file's error ends with it


def _plain(value: Any) -> bool:
    return not isinstance(value, bool)  # YAML's true/false is not a number


STR = Kind("str", "a non-empty string", lambda v: isinstance(v, str) and v != "")
INT = Kind("int", "a whole number", lambda v: isinstance(v, int) and _plain(v), {"type": int})
GB = Kind("float", "a number of GB", lambda v: isinstance(v, (int, float)) and _plain(v),
          {"type": float})
TIME = Kind("time", "minutes or a Slurm time string like 04:00:00",
            lambda v: isinstance(v, (int, str)) and _plain(v))
# a store_true flag cannot say no: False is "not given", so a site's true would stand
BOOL = Kind("bool", "true or false", lambda v: isinstance(v, bool),
            {"action": "store_true", "default": False}, normal=lambda v: True if v else None)
# a repeatable flag; none given (or an empty list) is "not given", one string is one item
LIST = Kind("list", "a list of strings",
            lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
            {"action": "append", "default": []},
            normal=lambda v: ((v,) if isinstance(v, str) else tuple(v)) if v else None,
            shown=lambda v: type(v).__name__, fix="; write one item per '- ' line")
NODES = Kind("nodes", "a node count or MIN-MAX", lambda v: isinstance(v, (int, str)) and _plain(v))


@dataclass(frozen=True)
class Option:
    """One launch option. `name` is its CLI flag's dest and its API key (the one name both
    front ends hand on); None in a column: not there."""

    name: str
    flag: Optional[str]  # the command line's flag
    api: Optional[str]  # the API's `cluster=` key
    site: Optional[str]  # the site file's key
    spec: Optional[str]  # the JobSpec field it becomes
    kind: Kind
    default: Any  # when neither a flag, a `cluster=` key nor the site file gives it
    help: str
    shape: bool = False  # read into the launch shape (ShapeRequest), on local runs too
    metavar: Optional[str] = None

    def flag_arguments(self) -> dict[str, Any]:
        """argparse's keywords for the flag."""
        extra = {"metavar": self.metavar} if self.metavar else {}
        return {"dest": self.name, "default": None, **self.kind.flag, "help": self.help, **extra}


OPTIONS: tuple[Option, ...] = (
    #      name, CLI flag, API key, site key, JobSpec field, kind, default, help
    Option("partition", "--partition", "partition", "partition", "partition", STR, None,
           "Slurm partition (default: the site config's)"),
    Option("account", "--account", "account", "account", "account", STR, None,
           "Slurm account the job is charged to (default: the site config's)"),
    Option("qos", "--qos", "qos", "qos", "qos", STR, None,
           "Slurm quality of service (default: the site config's)"),
    Option("time", "--time", "time", "time", "time", TIME, 60,
           "minutes or a Slurm time string (e.g. 2-00:00:00)"),
    Option("exclusive", "--exclusive", "exclusive", None, "exclusive", BOOL, False,
           "whole nodes (#SBATCH --exclusive)"),
    Option("container", "--container", "container", "image", "container_image", STR, None,
           "squashfs path or registry image for Pyxis; 'none' runs bare metal"),
    Option("mounts", "--mount", "mounts", "mounts", "container_mounts", LIST, (),
           "bind mount for the container (repeatable; replaces the site's list)",
           metavar="SRC:DST[:FLAGS]"),
    Option("python", "--python", "python", "python", "python", STR, "python3",
           "interpreter the tasks run (inside the container)"),
    Option("site", "--site", "site", None, None, STR, None,
           "site config YAML (default: search order, see docs)"),
    Option("job_name", "--job-name", "job_name", None, "job_name", STR, None,
           "Slurm job name (default: enn-RUN_NAME)"),
    Option("cpus_per_task", "--cpus-per-task", "cpus_per_task", "cpus_per_task",
           "cpus_per_task", INT, None,
           "CPUs per task (default: site, else the node's CPUs / tasks per node)"),
    Option("mem_gb", "--mem-gb", "mem_gb", "mem_gb", "mem_gb", GB, None,
           "memory per node in GB (sbatch --mem; 0: all of it; default: site, else Slurm's)"),
    Option("signal_grace", "--signal-grace", "signal_grace", "signal_grace_s",
           "signal_grace_s", INT, 90, "seconds between the USR2 warning and the time limit"),
    # the launch shape: local runs take these too
    Option("nodes", "--nodes", "nodes", None, "nodes", NODES, None,
           "nodes (simulated when local); on Slurm MIN-MAX takes what is granted", shape=True),
    Option("gpus_per_node", "--gpus-per-node", "gpus_per_node", "gpus_per_node",
           "gpus_per_node", INT, None, "GPUs per node (0: CPU)", shape=True),
    Option("procs_per_node", "--procs-per-node", "procs_per_node", None, "procs_per_node",
           INT, None, "processes per node on CPU (default: GPUs per node, or the config)",
           shape=True),
    Option("spare_nodes", "--spare-nodes", "spare_nodes", "spare_nodes", "spare_nodes", INT, 0,
           "nodes held idle in the job, each to take a lost node's place at the same world "
           "size (Slurm)"),
    Option("max_restarts", "--max-restarts", None, None, "max_restarts", INT, None,
           "retries after a worker failure (default: parallel.max_restarts)", shape=True),
    # the site file's alone
    Option("runs_root", None, None, "runs_root", None, STR, None,
           "where run directories go (shared filesystem)"),
    Option("image_cache", None, None, "image_cache", None, STR, None,
           "where built squashfs images go (shared filesystem)"),
    Option("nccl_profile", None, None, "nccl_profile", "nccl_profile", STR, "auto",
           "auto | efa | ib | socket | none"),
    Option("extra_sbatch_args", None, None, "extra_sbatch_args", "extra_sbatch_args", LIST, (),
           "more #SBATCH options, --key=value"),
    Option("extra_srun_args", None, None, "extra_srun_args", "extra_srun_args", LIST, (),
           "more srun options, one per item"),
    Option("setup_lines", None, None, "setup_lines", "setup_lines", LIST, (),
           "shell lines run on the host before srun"),
    Option("socket_ifname", None, None, "socket_ifname", None, STR, None,
           "control-plane NIC (gloo + NCCL bootstrap)"),
    Option("gpu_request", None, None, "gpu_request", "gpu_request", STR, "gpus-per-node",
           "how jobs ask for GPUs: gpus-per-node | gres | gres:TYPE"),
    Option("gpu_mem_gb", None, None, "gpu_mem_gb", None, GB, None,
           "memory of one GPU, for the memory plan (default 80)"),
    Option("wckey", None, None, "wckey", "wckey", STR, None, "--wckey for every job"),
    Option("whole_node_gpus", None, None, "whole_node_gpus", None, INT, WHOLE_NODE_GPUS,
           "GPUs per node from which a job gets --exclusive --mem=0 (0: never)"),
    Option("allow_socket_fallback", None, None, "allow_socket_fallback", None, BOOL, None,
           "NCCL over TCP on EFA/IB nodes: run (true) or stop"),
)

API_KEYS = tuple(o.api for o in OPTIONS if o.api)


def asked(get: Callable[[str], Any]) -> dict[str, Any]:
    """What a front end asked of Slurm, by option name: `get(name)` is the flag's or the
    `cluster=` key's value (None: not given). The shape's options are the launch plan's."""
    return {o.name: o.kind.normal(get(o.name)) for o in OPTIONS
            if (o.flag or o.api) and not o.shape}


def defaults() -> dict[str, Any]:
    """Every option's default, by name."""
    return {o.name: o.default for o in OPTIONS}


def site_values(site: Any) -> dict[str, Any]:
    """A SiteConfig's values, by option name (None: not set there)."""
    return {o.name: getattr(site, o.site) for o in OPTIONS if o.site}
