"""Hostile strings executed on the real local Slurm cluster (2 nodes in network namespaces).

Job names, mounts and run directory paths with shell metacharacters never reach a script:
they are refused in one line before anything is submitted or written (#SBATCH lines and
Pyxis cannot carry them). What does reach a script - extra environment values, the
interpreter path, srun arguments - is quoted: here it runs for real under sbatch/srun, a
`$(touch ...)`, backticks or `;` in it never executes, and every string arrives verbatim
(the job name in `scontrol show job`, the values in each task's argv and environment).
Run with: flock /tmp/enn-slurm-test.lock .venv/bin/python -m pytest tests/slurm/test_slurm_hostile.py
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from enn_cluster.storage import layout

from helpers import ROOT, metrics, small_config

pytestmark = pytest.mark.slurm

WRAPPER = """#!/bin/bash
# stands in for the interpreter: records what the task received, then runs the real one
out="${{ENN_TEST_OUT:?}}/task-${{SLURM_JOB_ID:-x}}-${{SLURM_PROCID:-x}}"
printf '%s\\0' "$0" "$@" > "$out.argv"
env -0 > "$out.env"
exec {python} "$@"
"""


class Hostile:
    """Strings that would create /tmp/PWNED_<tag>_* if any shell ever evaluated them."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:10]
        self.sentinels = [Path(f"/tmp/PWNED_{self.tag}_{c}") for c in "abcdp"]
        a, b, c, d, p = (str(s) for s in self.sentinels)
        self.line = (f"a b 'q' \"d\" $(touch {a}) `touch {b}`; touch {c} && touch {d} "
                     "ü ✓ $HOME ${PATH} \\ * ~ #, : %j")
        self.multiline = self.line + "\nsecond line\ttab\n"
        rel = f"PWNED_{self.tag}_rel"  # a path component holds no '/': relative to the cwd
        self.dirname = f"py dir $(touch {rel}) `touch {rel}` 'q' \"d\"; ü"

    def assert_nothing_ran(self, *dirs: Path) -> None:
        assert not [s for s in self.sentinels if s.exists()], "a hostile string executed"
        for d in dirs:
            assert not list(d.rglob("PWNED*")) and not list(d.rglob("CANARY*"))


@pytest.fixture
def hostile():
    h = Hostile()
    yield h
    for s in h.sentinels:
        s.unlink(missing_ok=True)


def wrapper(tmp_path: Path, hostile: Hostile) -> Path:
    """An interpreter whose path holds spaces, quotes, `$()`, backticks and ';'."""
    d = tmp_path / hostile.dirname
    d.mkdir()
    path = d / "python"
    path.write_text(WRAPPER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def task_records(out: Path, job: str) -> list[tuple[list[str], dict[str, str]]]:
    recs = []
    for argv_file in sorted(out.glob(f"task-{job}-*.argv")):
        argv = argv_file.read_bytes().decode().split("\0")[:-1]
        env_items = argv_file.with_suffix(".env").read_bytes().decode().split("\0")[:-1]
        recs.append((argv, dict(i.split("=", 1) for i in env_items if "=" in i)))
    return recs


def leaks(root: Path, values) -> list[str]:
    return [f"{p.relative_to(root)}" for p in root.rglob("*") if p.is_file()
            and any(v.encode() in p.read_bytes() for v in values)]


def test_rendered_script_with_hostile_values_runs_on_slurm(slurm_cluster, tmp_path, hostile):
    """`render_batch_script` with a hostile env value (newlines included), interpreter
    path and srun argument, submitted with plain sbatch: 1 node x 2 tasks train 2 steps."""
    from enn_cluster.cluster import job_spec
    from enn_cluster.cluster import job_script
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.client.prepare import LaunchShape, prepare_run

    shape = LaunchShape(1, 2)
    cfg = config_from_dict(small_config(tmp_path, "hostile", training={"max_steps": 2},
                                        parallel={"nodes": 1, "procs_per_node": 2}))
    run = prepare_run(cfg, shape)
    out = tmp_path / "task-out"
    out.mkdir()
    python = wrapper(tmp_path, hostile)
    name = "enn-hostile-ü.1+x"
    spec = job_spec.JobSpec(
        job_name=name, run_dir=str(run.path), nodes=1, gpus_per_node=0, procs_per_node=2,
        time=10, nccl_profile="socket", python=str(python), max_restarts=0,
        env={"ENN_NOTE": hostile.multiline, "ENN_TEST_OUT": str(out)},
        extra_srun_args=(f"--comment={hostile.line}",), setup_lines=("echo enn-setup-ran >&2",))
    script = tmp_path / "job.sbatch"
    script.write_text(job_script.render_batch_script(spec))
    token = f"hf-{uuid.uuid4().hex}"
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT), "HF_TOKEN": token}
    sub = slurm_cluster.run(["sbatch", "--parsable", str(script)], env=env, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    slurm_cluster.wait_job(job, ("COMPLETED",), timeout=120)

    hostile.assert_nothing_ran(tmp_path)
    _, text = slurm_cluster.job_state(job)
    assert f"JobName={name} " in text, text
    records = task_records(out, job)
    assert len(records) == 2, list(out.iterdir())
    for argv, task_env in records:
        assert argv == [str(python), "-m", "enn_cluster.worker", str(run.path), "--task", "train"]
        assert task_env["ENN_NOTE"] == hostile.multiline
        assert task_env["HF_TOKEN"] == token  # passed through the environment...
    assert metrics(run.path, "train")[-1]["step"] == 2
    batch_log = layout.batch_log(run.path, job).read_text()
    assert "enn-setup-ran" in batch_log
    assert token not in script.read_text() and leaks(run.path, [token]) == []  # ...only


def test_hostile_interpreter_and_srun_args_through_enn_submit(slurm_cluster, tmp_path, hostile):
    """The CLI path (submitit): --python with a hostile path, a site file's srun argument
    with a hostile value, a unicode job name; umask 000 in the submitter."""
    cfg = small_config(tmp_path, "hostile-cli", training={"max_steps": 2},
                       parallel={"nodes": 1, "procs_per_node": 2})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"extra_srun_args": [f"--comment={hostile.line}"]},
                                   allow_unicode=True))
    out = tmp_path / "task-out"
    out.mkdir()
    python = wrapper(tmp_path, hostile)
    token = f"mlflow-{uuid.uuid4().hex}"
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT), "ENN_TEST_OUT": str(out),
           "MLFLOW_TRACKING_TOKEN": token}
    env.pop("ENN_SITE_CONFIG", None)
    res = subprocess.run(
        [sys.executable, "-m", "enn_cluster.client.cli", "train", "--config", "run.yaml",
         "--cluster", "slurm", "--container", "none", "--time", "10", "--site", str(site),
         "--python", str(python), "--job-name", "enn-ĥostile", "--gpus-per-node", "0",
         "--procs-per-node", "2", "--nodes", "1", "--wait"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: os.umask(0))
    assert res.returncode == 0, res.stderr[-3000:]
    job = res.stdout.strip().splitlines()[-1]
    run = tmp_path / "runs" / "hostile-cli"

    hostile.assert_nothing_ran(tmp_path)
    _, text = slurm_cluster.job_state(job)
    assert "JobName=enn-ĥostile " in text, text
    records = task_records(out, job)
    assert len(records) == 2, list(out.iterdir())
    for argv, task_env in records:
        assert argv[0] == str(python) and argv[1:4] == ["-u", "-m", "submitit.core._submit"]
        assert task_env["MLFLOW_TRACKING_TOKEN"] == token
    assert metrics(run, "train")[-1]["step"] == 2
    assert leaks(run, [token]) == [] and token not in res.stdout + res.stderr
    # the job's own files (submitit's folder, logs, checkpoints) follow the submitter's
    # umask, which enn-submit set: nothing world-writable, everything group-readable
    bad = [f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p.relative_to(run)}"
           for p in [run, *run.rglob("*")] if not p.is_symlink()
           and (p.lstat().st_mode & stat.S_IWOTH or not p.lstat().st_mode & stat.S_IRGRP)]
    assert bad == []


@pytest.mark.parametrize("flags, field", [
    (["--job-name", "x$(touch {p})"], "--job-name"),
    (["--job-name", "a b;touch {p}"], "--job-name"),
    (["--container", "/img/enn.sqsh", "--mount", "/data:/d $(touch {p})"], "--mount"),  # the flag typed
    (["--container", "/img/enn.sqsh", "--mount", "/a,/b:`touch {p}`"], "--mount"),  # the flag typed
    (["--set", "runs_root={tmp}/r s;$(touch {p})"], "RUN_DIR"),
    (["--set", "run_name=a'b`touch PWNED_rn`;$(touch PWNED_rn2)"], "RUN_DIR"),
    (["--partition", "gpu\n#SBATCH --uid=0"], "--partition"),
])
def test_hostile_names_never_reach_slurm(slurm_cluster, tmp_path, hostile, flags, field):
    """Refused in one line before a run directory exists or sbatch is called."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(small_config(tmp_path, "never")))
    p = hostile.sentinels[-1]
    args = [f.format(p=p, tmp=tmp_path) for f in flags]
    if "--container" not in args:  # bare metal: no image to look up
        args += ["--container", "none"]
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                          "run.yaml", "--cluster", "slurm", "--time", "10", *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and field in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before
    hostile.assert_nothing_ran(tmp_path)
