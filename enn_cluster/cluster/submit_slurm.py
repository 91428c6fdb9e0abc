"""Submit a run's task to Slurm through submitit: one task per GPU, the same worker entry.

`job_spec` and `job_script` decide every flag (pure, golden-tested); this module only turns
CLI flags and the site config into a JobSpec, hands it to submitit, and records the job in
the run.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.submitit_adapter import (  # noqa: F401 (batch_script: render's)
    batch_script,
    refused_errors,
    slurm_executor,
    submit_call,
    unreadable_reply,
)
from enn_cluster.config.launch_env import SUBMISSION_VAR, handed_to_workers
from enn_cluster.config.launch_shape import LaunchShape
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.inputs import INPUTS, ON_SLURM
from enn_cluster.errors import Said, UserError
from enn_cluster.storage import commits as store, layout
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.rundir import RunDir, run_umask
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, release_lock, replace_lock
from enn_cluster.worker.slurm_entry import code_identity, worker_entry


def default_job_name(run_name: str) -> str:
    """'enn-' + the run name, with what an #SBATCH line cannot carry made '_' (a run name
    may hold spaces or '='; the user did not ask for them in a job name)."""
    import re

    return re.sub(r"[^\w.+-]", "_", f"enn-{run_name}")[:64]


def image_cache_dir(site_cache: Optional[str]) -> Path:
    """--cache-dir aside: $ENN_IMAGE_CACHE, then the site's image_cache, then ~/.cache."""
    from enn_cluster.cluster.image_key import default_cache_dir

    if site_cache and not os.environ.get("ENN_IMAGE_CACHE"):
        return Path(site_cache).expanduser()
    return default_cache_dir()


def default_image(site_cache: Optional[str]) -> Path:
    """No --container and no site image: the image built from ./containers/Dockerfile."""
    from enn_cluster.cluster.image_key import image_for

    dockerfile = Path("containers/Dockerfile")
    if not dockerfile.is_file():
        raise UserError("no image given (flag or site config) and no containers/Dockerfile "
                        "here to find a built one for", field=INPUTS["container"],
                        fix="pass {image}, or {bare} to run without Pyxis", bare=BARE,
                        image=Said(INPUTS["container"], "IMAGE"))
    try:
        return image_for(dockerfile, ".", image_cache_dir(site_cache))
    except UserError as exc:
        raise UserError("{why} (or pass {image} or {bare})", field=INPUTS["container"],
                        why=str(exc), image=Said(INPUTS["container"], "IMAGE"),
                        bare=BARE) from None


@dataclass(frozen=True)
class SlurmRequest:
    """What the user asked of Slurm, from CLI flags or the API's `cluster=` dict: the launch
    options' values by name (`asked`: launch_options.asked; None means "the site config's,
    else the default"). The node count is the launch shape's (config/launch_shape.py), not
    the request's."""

    asked: Mapping[str, Any] = field(default_factory=dict)
    wait: bool = False
    site_config: Optional[object] = None  # the SiteConfig of `site`, when already read

    def site_options(self):
        """The site config: the one already read for this command, else read now."""
        from enn_cluster.cluster.site import load_site

        return self.site_config if self.site_config is not None else \
            load_site(self.asked.get("site"))



def build_spec(req: SlurmRequest, run_dir: Path, task: str, shape: LaunchShape,
               max_restarts: int, name: Optional[str] = None, *, cfg: RunConfig,
               read_dirs=()) -> JobSpec:
    """The job for the run at `run_dir` (which need not exist yet). Each launch option's
    value reaches its JobSpec field (config/launch_options.py), the flag's winning over the
    site config's, which wins over the default (site.merge); the shape is the plan's.
    Decided here: the default job name (`cfg`'s run_name), the USR2 grace (the run's last
    save), the default image, bare metal's mounts and interpreter, and whole nodes for a
    job asking for every GPU of one (slurm_values.whole_node_request). `read_dirs`: what
    its model's kind reads besides the run (mounted read-only). CPUs per task that neither
    sets are left to `sized_for_nodes`, when the job is handed over."""
    from enn_cluster.cluster.site import merge
    from enn_cluster.cluster.slurm_values import whole_node_request
    from enn_cluster.config.launch_options import OPTIONS, defaults, site_values

    asked = req.asked
    opts = merge(defaults(), site_values(req.site_options()), asked)
    if opts["job_name"] is None:
        opts["job_name"] = default_job_name(cfg.run_name)
    if asked.get("signal_grace") is None:  # no flag: a grace the run's last save fits in
        opts["signal_grace"] = measured_grace(RunDir(Path(run_dir)), opts["signal_grace"],
                                              opts["time"])
    if opts["container"] is None:
        opts["container"] = str(default_image(opts["image_cache"]))
    if opts["container"] == "none":  # bare metal
        if asked.get("mounts"):  # the site's mounts are for its images; a flag's are meant
            raise UserError("{count} mount(s) given with {bare} (bare metal mounts nothing)",
                            field=INPUTS["mounts"], value=asked["mounts"],
                            count=len(asked["mounts"]), bare=BARE,
                            fix="drop {field} or name an image")
        # the tasks run this very interpreter (same venv on a shared filesystem)
        opts.update(container=None, mounts=(), python=asked.get("python") or sys.executable)
    else:
        opts["mounts"] = (*opts["mounts"], *read_mounts(read_dirs, opts["mounts"]))
    opts["exclusive"], opts["mem_gb"] = whole_node_request(
        shape.gpus_per_node, opts["whole_node_gpus"], opts["exclusive"], opts["mem_gb"])
    fields = {o.spec: opts[o.name] for o in OPTIONS if o.spec and not o.shape}
    return JobSpec.for_shape(shape, run_dir=str(run_dir), task=task, predict_name=name,
                             max_restarts=max_restarts, env=site_env(opts), **fields)


def measured_grace(run: RunDir, grace_s: int, time) -> int:
    """The USR2 grace for a job of this run: the site's, raised (with a line saying so)
    when the run's newest checkpoint took longer to save than it leaves, up to the time
    limit less the 60 s Slurm may send it early and a minute of training."""
    found = store.last_save_seconds(run.checkpoints)
    if found is None:
        return grace_s
    from enn_cluster.cluster.slurm_values import time_minutes

    limit = max(grace_s, time_minutes(time) * 60 - 120)
    chosen = store.grace_for_save(found[1], grace_s, limit)
    if chosen != grace_s:
        print(f"signal grace: {chosen} s, not {grace_s} s: checkpoint step-{found[0]} took "
              f"{found[1]:.0f} s to save (--signal-grace sets it)", file=sys.stderr)
    return chosen


def read_mounts(dirs, mounts) -> tuple[str, ...]:
    """The directories a model reads besides the run (its kind's `read_dirs`: a Hugging Face
    run's weights and tokenizer), each mounted read-only at its own path, unless a mount
    already covers it. A model in the local HF cache mounts its whole cache entry (the
    snapshot's files are links into its blobs)."""
    from enn_cluster.cluster import pyxis

    covered = [m.dst for m in pyxis.parse_mounts(tuple(mounts), INPUTS["container_mounts"])]
    out: list[str] = []
    for path in map(Path, dirs):
        entry = next((p for p in (path, *path.parents) if p.name.startswith("models--")), path)
        text = pyxis.check_path(str(entry), "model.name", "weights directory")
        if not any(text == c or text.startswith(c.rstrip("/") + "/") for c in [*covered, *out]):
            out.append(text)
    return tuple(f"{p}:{p}:ro" for p in out)


def site_env(opts: dict) -> dict:
    """Variables the site's keys hand every task (Pyxis passes them into the container)."""
    env = {"ENN_SOCKET_IFNAME": opts["socket_ifname"]} if opts["socket_ifname"] else {}
    if opts.get("allow_socket_fallback"):
        env["ENN_ALLOW_SOCKET_FALLBACK"] = "1"
    return env


def sized_for_nodes(spec):
    """`spec` with CPUs per task from its partition's nodes (partition_shape) when neither
    --cpus-per-task nor the site set them (an --exclusive job has whole nodes: its own
    fallback is right). Asked of Slurm as the job is handed over (submit, render); when
    Slurm cannot say, the spec as it was and the line that says so: `submit` refuses a GPU
    job with it (one CPU per task on a shared node starves eight CUDA processes) and
    prints it as a warning for a CPU job; `render` prints it as a warning."""
    import dataclasses

    from enn_cluster.cluster.partition_shape import cpus_from_slurm

    if spec.cpus_per_task is not None or spec.exclusive:
        return spec, ""
    # sbatch sends a job that names no partition to SBATCH_PARTITION's, if set
    partition = spec.partition or os.environ.get("SBATCH_PARTITION") or None
    cpus, why = cpus_from_slurm(partition, spec.gpus_per_node, spec.tasks_per_node)
    if cpus is not None:
        return dataclasses.replace(spec, cpus_per_task=cpus), ""
    fix = "pass --cpus-per-task or set site.cpus_per_task"
    if spec.gpus_per_node:
        return spec, (f"--cpus-per-task: CPUs per task not sized from the nodes ({why}), and "
                      f"a GPU job would get 1 CPU per task on a shared node; {fix} (or "
                      "--exclusive)")
    return spec, (f"enn-submit: warning: CPUs per task not sized from the nodes ({why}): "
                  f"each task gets its allocation's CPUs on the node / tasks, 1 on a shared "
                  f"node; {fix}")


# Filesystems in this machine's memory: a path on one exists on this node alone.
MEMORY_FS = ("tmpfs", "ramfs")


def filesystem_type(path: Path, mounts: str) -> Optional[str]:
    """The type of the filesystem holding `path`, from /proc/self/mounts text (the
    longest mount point above it; mount points escape spaces as \\040)."""
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def node_local_problem(run_dir: Path, mounts: str) -> Optional[str]:
    """A run directory in this login node's memory (tmpfs: /tmp or /dev/shm on many
    hosts, a relative runs_root resolved there) is not the one the compute nodes see."""
    kind = filesystem_type(Path(run_dir), mounts)
    if kind not in MEMORY_FS:
        return None
    return (f"runs_root: the run directory {run_dir} is on {kind}, this machine's memory, "
            "which the compute nodes do not see; set runs_root (config or site) to a path "
            "on the shared filesystem")


def _read_mounts() -> str:
    try:
        return Path("/proc/self/mounts").read_text()
    except OSError:
        return ""


def submitit_folder(run_dir: Path) -> Path:
    """Where submitit keeps a job's pickles and logs; the batch script names it."""
    return Path(run_dir) / layout.SUBMITIT / "%j"


# What Slurm's clients say where no slurm.conf, SLURM_CONF or DNS SRV record names a cluster.
NO_CONFIG = "Could not establish a configuration source"
NOT_CONFIGURED = "Slurm is not configured on this machine (no slurm.conf, SLURM_CONF or DNS record)"
SLURM_FIX = ("submit from a Slurm login node, or run here without --cluster slurm "
             "(`enn-submit render` shows the script from anywhere)")
API_SLURM_FIX = "submit from a Slurm login node, or run here with cluster=None"
BARE = Said(INPUTS["container"], "none")  # bare metal: no Pyxis


def slurm_refusal(problem: str, fix: str = SLURM_FIX) -> UserError:
    """This machine cannot submit to Slurm, in each front end's words."""
    return UserError("{problem}", field=ON_SLURM, problem=problem, fix=fix,
                     api_fix=API_SLURM_FIX if fix == SLURM_FIX else None)


def slurm_problem(has_sbatch: bool, ping) -> Optional[UserError]:
    """Why this machine cannot submit to Slurm, or None: from whether sbatch is on PATH and
    `scontrol ping`'s result (None: no scontrol, or no answer in time; then sbatch says).
    Only what Slurm's clients say plainly is refused here; anything else is sbatch's to say."""
    if not has_sbatch:
        return slurm_refusal("this machine has no Slurm (no sbatch on PATH)")
    if ping is None or ping.returncode == 0:
        return None
    said = f"{ping.stdout}\n{ping.stderr}"
    if NO_CONFIG in said:
        return slurm_refusal(NOT_CONFIGURED)
    down = next((line.strip() for line in said.splitlines() if line.rstrip().endswith(" DOWN")),
                None)
    if down:
        return slurm_refusal(f"the Slurm controller does not answer (scontrol ping: {down})",
                             "try again when it is back, or ask the cluster's admins")
    return None


def check_slurm_here() -> None:
    """Refuse, in one line, a Slurm launch from a machine that cannot submit one: before
    anything else about the job is looked for (its image, its run directory)."""
    import shutil

    from enn_cluster.cluster.slurm import ping

    has_sbatch = shutil.which("sbatch") is not None
    problem = slurm_problem(has_sbatch, ping() if has_sbatch else None)
    if problem:
        raise problem


def submit(run: RunDir, spec, step: Optional[int] = None, *, cfg) -> str:
    """Submit and record; refuse while another live job holds the run (`cfg`: the run's
    config as the command holds it, for the MLflow run the job logs into).

    The run lock is claimed (O_EXCL, this process) before sbatch and handed to the job
    after it: of two clients racing `resume` on one run, one submits and the other is
    refused, never both. The claim's token reaches the job (SUBMISSION_VAR), so a job that
    starts before the hand-over knows the lock is its own."""
    import secrets

    from enn_cluster.storage.run_lock import for_run
    from enn_cluster.cluster.slurm import job_alive
    from enn_cluster.storage.tracking import ensure_run

    check_slurm_here()
    _check_lock(run, for_run(run.path, job_alive))
    problem = node_local_problem(run.path, _read_mounts())
    if problem:
        raise UserError(problem)
    spec, warning = sized_for_nodes(spec)
    if warning and spec.gpus_per_node:
        raise UserError(warning)
    token = secrets.token_hex(8)
    claim = acquire_lock(run, {**lock_owner(), "submission": token}, slurm_job_alive=job_alive)
    try:
        tracking = ensure_run(run, cfg)
        executor = slurm_executor(spec, submitit_folder(run.path))
        # sbatch exports the environment, and the umask, to the job
        with run_umask(), handed_to_workers({SUBMISSION_VAR: token, **tracking}):
            job_id = submit_call(executor, worker_entry, str(run.path), spec.task,
                                 spec.predict_name, step, code_identity())  # refuses other code
    except unreadable_reply() as exc:
        release_lock(run, claim)
        said = " ".join(str(exc).split('"')[1].split())[:160] if '"' in str(exc) else "?"
        raise UserError(f"sbatch: its reply {said!r} names no job id (a site wrapper around "
                        "sbatch?); check 'squeue --me' before submitting again") from None
    except refused_errors() as exc:
        release_lock(run, claim)
        said = (str(exc).strip().splitlines() or ["no message"])[-1]
        if NO_CONFIG in said:
            raise slurm_refusal(f"{NOT_CONFIGURED} (sbatch: {NO_CONFIG})") from None
        raise UserError(f"sbatch refused the job: {said}")
    except BaseException:
        release_lock(run, claim)
        raise
    if warning:
        print(warning, file=sys.stderr)
    replace_lock(run, {"slurm_job_id": job_id, "host": "slurm", "pid": 0,
                       "submitted_by": "enn-submit", "submission": token})
    run.record_job(JobRecord(kind="slurm", job_id=job_id, job_name=spec.job_name, task=spec.task,
                             name=spec.predict_name, nodes=spec.nodes,
                             tasks_per_node=spec.tasks_per_node, image=spec.container_image,
                             signal_grace_s=spec.signal_grace_s))
    return job_id


def _check_lock(run: RunDir, job_alive) -> None:
    from enn_cluster.storage.run_lock import read_lock

    owner = read_lock(run)
    if owner and owner.get("slurm_job_id") and job_alive(owner["slurm_job_id"]):
        raise UserError(f"run directory {run.path} is in use by Slurm job "
                        f"{owner['slurm_job_id']}; wait for it or 'enn-submit cancel {run.path}'")
    if owner and not owner.get("slurm_job_id"):
        from enn_cluster.storage.run_lock import owner_alive

        if owner_alive(owner):
            raise UserError(f"run directory {run.path} is in use by pid {owner['pid']} on "
                            f"{owner['host']}; wait for it or 'enn-submit cancel {run.path}'")
    # a stale lock is left for acquire_lock, which takes it over by renaming it aside

