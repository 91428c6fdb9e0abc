"""Every use of submitit, in one place: build the executor for a JobSpec, render the batch
script it would hand to sbatch, submit, and tell its errors apart.

submitit writes the sbatch script and pickles the call; three of the things we need from it
are not its public API: the text of the script without submitting (`render`), building a
Slurm executor on a machine without srun (`render` from a laptop), and its parameter
conversion. `PRIVATE_SURFACE` names each of them with the signature we call;
`surface_problems()` says what an installed submitit lacks of it (tests/cluster/test_submitit_adapter.py
runs it), and pyproject.toml's bound on submitit is the range that test has passed on.
"""
from __future__ import annotations

import inspect
from pathlib import Path

# pyproject.toml's bound: surface_problems() and the golden submitit script pass on 1.5.0
# and 1.5.4 (the newest release); a minor release may rename what we reach into.
TESTED_RANGE = "submitit>=1.5,<1.6"

# (dotted attribute under `submitit`, the parameters we pass, in order; None: not called)
PRIVATE_SURFACE = (
    ("slurm.slurm.SlurmExecutor.__init__", ("self", "folder", "python")),
    ("slurm.slurm.SlurmExecutor.affinity", ("cls",)),
    ("slurm.slurm.SlurmExecutor._convert_parameters", ("self", "params")),
    ("slurm.slurm.SlurmExecutor._make_submission_file_text", ("self", "command", "uid")),
    ("slurm.slurm.SlurmExecutor._submitit_command_str", None),
    ("slurm.slurm._make_sbatch_string", ("command", "folder", "job_name", "partition", "time",
                                         "nodes", "ntasks_per_node", "cpus_per_task",
                                         "gpus_per_node", "setup", "mem", "signal_delay_s",
                                         "srun_args", "additional_parameters", "wckey",
                                         "gres", "exclusive", "account", "qos")),
    ("core.utils.FailedSubmissionError", None),
    ("core.utils.FailedJobError", None),
)

# AutoExecutor's generic names -> SlurmExecutor's (what `submitit_parameters` writes)
GENERIC = ("name", "timeout_min", "mem_gb", "nodes", "cpus_per_task", "gpus_per_node",
           "tasks_per_node")


def surface_problems(root=None) -> list[str]:
    """What `root` (the submitit package) lacks of PRIVATE_SURFACE: one line per missing
    attribute or parameter; [] when every private call we make would still work."""
    if root is None:
        import submitit.core.utils
        import submitit.slurm.slurm

        root = submitit
    problems = []
    for dotted, wanted in PRIVATE_SURFACE:
        obj = root
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is None:
            problems.append(f"submitit.{dotted}: missing")
            continue
        if wanted is None:
            continue
        have = list(inspect.signature(obj).parameters)
        if inspect.ismethod(obj) and have[:1] != ["cls"]:
            have = ["cls", *have]  # a classmethod's signature drops cls
        lost = [p for p in wanted if p not in have]
        if lost:
            problems.append(f"submitit.{dotted}: no parameter {', '.join(lost)}")
    return problems


def installed_version() -> str:
    from importlib.metadata import version

    return version("submitit")


def _executor_class():
    from submitit.slurm.slurm import SlurmExecutor

    class RenderableSlurmExecutor(SlurmExecutor):
        """submitit's Slurm executor, buildable where srun is missing: `render` runs on any
        machine, and `submit` asks sbatch, which says itself when Slurm is absent."""

        @classmethod
        def affinity(cls) -> int:
            return 2

    return RenderableSlurmExecutor


def slurm_executor(spec, folder: Path):
    """The submitit executor that submits `spec`, and that `render` asks for the script:
    AutoExecutor's parameters (job_script.submitit_parameters) converted as AutoExecutor
    converts them, without its check for srun."""
    from enn_cluster.cluster.job_script import submitit_executor_kwargs, submitit_parameters

    python = submitit_executor_kwargs(spec)["slurm_python"]
    executor = _executor_class()(folder, python=python)
    params = submitit_parameters(spec)
    generic = {k: v for k, v in params.items() if k in GENERIC and v is not None}
    specific = {k.removeprefix("slurm_"): v for k, v in params.items() if k not in GENERIC}
    # submitit writes --wckey=submitit unless told None: the site's wckey or none (sites
    # enforcing wckeys reject "submitit")
    executor.update_parameters(**executor._convert_parameters(generic), **specific,
                               wckey=spec.wckey)
    return executor


def batch_script(executor) -> str:
    """The exact text `submit` writes and hands to sbatch: submitit's own rendering with the
    command it submits (`enn-submit render` prints this)."""
    return executor._make_submission_file_text(executor._submitit_command_str, "")


def submit_call(executor, fn, *args) -> str:
    """sbatch the call `fn(*args)` on every task; the job id."""
    return str(executor.submit(fn, *args).job_id)


def unreadable_reply():
    """sbatch answered, but with no job id submitit could read."""
    from submitit.core.utils import FailedSubmissionError

    return FailedSubmissionError


def refused_errors():
    """sbatch (or its wrapper) refused the job: its message is the exception's last line."""
    import subprocess

    from submitit.core.utils import FailedJobError

    return (subprocess.CalledProcessError, FailedJobError)
