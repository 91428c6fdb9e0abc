"""The run directory's layout, written down once: every file and folder of
`<runs_root>/<run_name>/` with its writer and readers, and the requeue/ markers through
which the batch shell (cluster/templates/host_setup.sh, whose marker names are filled in
from MARKERS) and the Python side talk. Pure data; `RunDir` (rundir.py) and the marker
readers take their names from here, and a test holds host_setup.sh and this table to each
other."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union


@dataclass(frozen=True)
class Entry:
    name: str     # relative to the run directory; <job>, <name>, N stand for parts
    writer: str
    readers: str
    what: str


CONFIG = "config.yaml"
CONFIG_HISTORY = "config-history"
DATA = "data"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"  # logging.metrics_path's default
LOGS = "logs"
BATCH_LOG = "slurm-{job}.out"  # under LOGS: a Slurm job's batch shell (stdout and stderr)
JOBS = "jobs.jsonl"
PREDICTIONS = "predictions"
LOCK = "run.lock"
SUBMITIT = "slurm"  # submitit's folder: slurm/<job>/
REQUEUE = "requeue"
OOM = "oom.json"
NONFINITE = "nonfinite"
PROFILES = "profiles"

# requeue/ markers of a Slurm job: the file is PREFIX + the job id
MARKERS = {
    "requeue": "",  # a worker stopped with a checkpoint: requeue this job
    "refused": "refused-",
    "failures": "failures-",
    "stop": "stop-",
    "probing": "probing-",
    "decision": "decision-",
    "relaunch": "relaunch-",
    "ended": "ended-",
}
LOCAL_MARKER = "local"  # the local launcher's "requeue me" (no job id)

LAYOUT = (
    Entry(CONFIG, "train/prepare (client), once; a resume's overrides rewrite it",
          "every worker and command", "the resolved run config"),
    Entry(f"{CONFIG_HISTORY}/", "resume with overrides", "status, doctor",
          "each earlier config.yaml"),
    Entry(f"{DATA}/", "prepare (staging)", "workers, predict, export, doctor",
          "staged memmaps + manifest.json (text: token ids and the tokenizer's checksum)"),
    Entry(f"{CHECKPOINTS}/step-N/", "workers (DCP), commit.json last",
          "resume, predict, export, verify, status", "a checkpoint, complete only with "
          "commit.json"),
    Entry(f"{CHECKPOINTS}/step-N.torn-<ns>", "a worker that finds step N torn",
          "prune (deleted once a newer step commits)", "a torn attempt, set aside"),
    Entry(METRICS, "rank 0", "status, plot, doctor, mlflow", "one JSON record per event"),
    Entry(f"{LOGS}/", "launchers (per attempt, per rank)", "logs, doctor", "rank logs"),
    Entry(f"{LOGS}/{BATCH_LOG.format(job='<job>')}",
          "Slurm: the batch shell of every job (--cluster slurm, render, the admin templates)",
          "--wait (its last lines), an operator", "the batch log: requeues, node loss, srun's errors"),
    Entry(OOM, "the rank that ran out of memory (storage/oom_record.py)",
          "the next attempt's OOM governor, status, doctor", "every out-of-memory event"),
    Entry(f"{NONFINITE}/step-N.json", "rank 0, when a log step finds new non-finite skips",
          "status, doctor", "the rows and parameters of the newest skipped step"),
    Entry(f"{PROFILES}/steps-<first>-<last>/", "every rank (profiling.steps)",
          "chrome://tracing, Perfetto", "one Chrome trace per rank"),
    Entry(JOBS, "every launch (local pid or Slurm job id)", "status, cancel, attempts",
          "one record per launch"),
    Entry(f"{PREDICTIONS}/<name>/", "predict (client stages, workers write chunks)",
          "collect, Run.predict", "prediction chunks + manifest"),
    Entry(LOCK, "the launcher or submitter that writes this run now",
          "every launcher, cancel, status", "who is writing this run now"),
    Entry(f"{SUBMITIT}/<job>/", "submitit (--cluster slurm)", "submitit, logs",
          "a job's pickles and submitit logs"),
    Entry(f"{REQUEUE}/<job>", "every rank that stopped with a checkpoint",
          "the batch shell's EXIT trap: requeue", "requeue this job"),
    Entry(f"{REQUEUE}/{LOCAL_MARKER}", "every rank that stopped with a checkpoint (local)",
          "the local launcher: relaunch", "relaunch this run"),
    Entry(f"{REQUEUE}/refused-<job>", "a rank that refused its input (exit 2)",
          "the EXIT trap: never requeue", "the refusal, one line"),
    Entry(f"{REQUEUE}/failures-<job>", "the EXIT trap", "the EXIT trap",
          "retries used of ENN_MAX_RESTARTS"),
    Entry(f"{REQUEUE}/stop-<job>", "the batch shell's USR2 trap", "rank 0, every step",
          "checkpoint and stop"),
    Entry(f"{REQUEUE}/probing-<job>", "the batch shell, while it asks which nodes answer",
          "status", "when the probe began"),
    Entry(f"{REQUEUE}/decision-<job>", "the batch shell's step watcher", "the batch shell",
          "what the watcher decided about a failed step"),
    Entry(f"{REQUEUE}/relaunch-<job>", "the batch shell, after a lost node",
          "workers (node_lost metric), status", "lost, nodes, min, time"),
    Entry(f"{REQUEUE}/ended-<job>", "the EXIT trap, when the job leaves for good",
          "run_lock (frees the run), status", "rc, time (lost, nodes, min)"),
)


def marker(run_path: Union[str, Path], kind: str, job_id) -> Path:
    """RUN/requeue/<prefix><job id> for one of MARKERS."""
    return Path(run_path) / REQUEUE / f"{MARKERS[kind]}{job_id}"


def batch_log(run_path: Union[str, Path], job_id) -> Path:
    """RUN/logs/slurm-<job id>.out: the one place every Slurm job's batch shell writes."""
    return Path(run_path) / LOGS / BATCH_LOG.format(job=job_id)


def batch_log_pattern(run_dir: str) -> str:
    """`batch_log` as sbatch's --output/--error pattern (%j: the job id)."""
    return f"{run_dir}/{LOGS}/{BATCH_LOG.format(job='%j')}"


def shell_names() -> dict:
    """host_setup.sh's @NAME@ placeholders for the markers: @REQUEUE@ and @MARK_<KIND>@."""
    return {"REQUEUE": REQUEUE,
            **{f"MARK_{kind.upper()}": prefix for kind, prefix in MARKERS.items()}}
