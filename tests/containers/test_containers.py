"""The container path for real: Pyxis + Enroot on the local Slurm cluster run our image.

Every job here starts its tasks in the squashfs that `enn-submit build` made from
containers/Dockerfile (the `test_image` fixture: built once per session, cached by hash).
The cluster runs Pyxis with use_squashfuse=1 (what docs/admin.md recommends) unless a test
asks for 0. Python in the image is Debian's 3.11.2; the host's may differ.
"""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from enn_cluster.storage import commits as store
from enn_cluster.storage import layout
from helpers import ROOT, cli, faults, metrics, small_config, wait_for_file, write_config
from pyxis_fixture import IMAGE_CACHE, build_test_image
from render_support import documented_cpu_only_flags

pytestmark = [pytest.mark.slurm, pytest.mark.podman]


def _slurm(image: Path) -> tuple[str, ...]:
    return ("--cluster", "slurm", "--container", str(image), "--time", "10")


def _submit(*args, env=None) -> str:
    res = cli(*args, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


# Issue 15 item 2, fixed on another branch: Debian's Python 3.11.2 (this image's) pickles
# DCP metadata enums through builtins.getattr, which our metadata allow-list refuses, so a
# checkpoint written inside the container cannot be loaded yet. Until that fix is merged,
# exactly that failure (found in the job's logs) turns the loading step into an xfail.
PY3112_METADATA = "refers to builtins.getattr"


def _xfail_if_py3112_metadata(run: Path, what: str) -> None:
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.err"))
    logs += "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    if PY3112_METADATA in logs:
        pytest.xfail(f"{what}: checkpoint metadata pickled by Python 3.11.2 ({PY3112_METADATA}); "
                     "issue 15 item 2")


def _started_in_container(cluster, job: str) -> bool:
    """slurmd's log on either node names Pyxis starting this job's container."""
    logs = Path(cluster.state_dir, "log").glob("slurmd-n*.log")
    text = "".join(p.read_text(errors="replace") for p in logs)
    return bool(re.search(rf"\[{job}\.\d+\].*pyxis", text)) or f"pyxis_{job}" in text


def test_train_2x2_in_the_container_then_resume_on_one_node(pyxis_cluster, test_image, tmp_path):
    cluster = pyxis_cluster(1)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "ct", training={"epochs": 2}))
    job = _submit("train", "--config", cfg, *_slurm(test_image), "--nodes", "2",
                  "--gpus-per-node", "2", "--wait")
    run = tmp_path / "runs" / "ct"
    cluster.wait_job(job, ("COMPLETED",), timeout=240)
    log = (run / "logs" / f"slurm-{job}-r0" / "rank-3.log").read_text()
    assert "worker rank 3/4 local 1 node 1" in log and "host n2" in log, log
    assert _started_in_container(cluster, job)
    assert metrics(run, "train")[-1]["step"] == 28
    res = cli("resume", run, *_slurm(test_image), "--nodes", "1", "--gpus-per-node", "2",
              "--set", "training.epochs=3", "--wait", timeout=300)
    if res.returncode != 0:
        _xfail_if_py3112_metadata(run, "resume in the container")
    assert res.returncode == 0, res.stderr[-3000:]
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["from_world"], resume["world_size"]) == (28, 4, 2)
    assert metrics(run, "train")[-1]["step"] == 28 + 14
    assert cli("verify", run).returncode == 0


def test_predict_in_the_container_then_collect_equals_local(pyxis_cluster, test_image, tmp_path):
    cluster = pyxis_cluster(1)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "cp", training={"epochs": 1}))
    trained = cli("train", "--config", cfg, "--nodes", "1", "--procs-per-node", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = tmp_path / "runs" / "cp"
    x = np.random.default_rng(5).standard_normal((200, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    job = _submit("predict", run, "--input", tmp_path / "x.npy", "--name", "box",
                  "--chunk-rows", "40", *_slurm(test_image), "--nodes", "2",
                  "--gpus-per-node", "2", "--wait")
    cluster.wait_job(job, ("COMPLETED",), timeout=240)
    assert _started_in_container(cluster, job)
    local = cli("predict", run, "--input", tmp_path / "x.npy", "--name", "local",
                "--chunk-rows", "40", "--nodes", "1", "--procs-per-node", "3")
    assert local.returncode == 0, local.stderr[-3000:]
    for name in ("box", "local"):
        got = cli("collect", run, "--name", name, "--out", tmp_path / f"{name}.npy")
        assert got.returncode == 0, got.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "box.npy"), np.load(tmp_path / "local.npy"))


def test_killed_rank_in_the_container_fails_fast_and_retry_resumes(pyxis_cluster, test_image,
                                                                   tmp_path):
    """Rank 2 (on n2) is SIGKILLed at step 25 (ENN_TEST_FAULTS fail_at_step: the worker kills
    itself, so no test signals a pid read from a file). Its peers must not hang on it: the
    step fails within seconds, the host-side trap requeues once (--max-restarts 1), and the
    retry resumes from the newest commit on disk."""
    cluster = pyxis_cluster(1)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "kill", training={"max_steps": 120},
        checkpoint={"every_steps": 10, "keep_last": 100}))  # every commit record stays
    job = _submit("train", "--config", cfg, *_slurm(test_image), "--nodes", "2",
                  "--gpus-per-node", "2", "--max-restarts", "1",
                  env=faults(fail_at_step=25, fail_rank=2))
    run = tmp_path / "runs" / "kill"
    marker = run / "faults" / "fired-step-25"
    wait_for_file(marker, timeout=240)
    killed_at = marker.stat().st_mtime
    cluster.wait_job(job, ("PENDING",), timeout=60)
    assert time.time() - killed_at < 45  # failed fast: no collective hung on the dead rank
    assert _started_in_container(cluster, job)
    cluster.release_requeued(job)
    cluster.wait_job(job, ("COMPLETED",), timeout=240)
    resume = metrics(run, "resume")[-1]
    # A save the dead rank had already done its part of may commit just after the kill, with
    # no metrics record (the save's closing barrier failed): the commit records on disk decide.
    ckpts = run / "checkpoints"
    commits = {s: store.read_commit(store.step_dir(ckpts, s)) for s in store.committed_steps(ckpts)}
    committed = [s for s, rec in commits.items() if rec["time"] < resume["time"]]
    assert resume["step"] == max(committed) >= 20, (commits, resume)
    assert metrics(run, "train")[-1]["step"] == 120
    assert (run / "requeue" / f"failures-{job}").read_text().strip() == "1"


def _sbatch_template(cluster, template: str, env: dict, *flags: str) -> str:
    """sbatch from the run's parent directory, as an admin from their own: Slurm's default
    slurm-JOB.out (empty: the template sends the batch log into the run) lands there."""
    proc = cluster.run(["sbatch", "--parsable", *flags, str(ROOT / "slurm" / template)],
                       env={**cluster.env, **env}, cwd=Path(env["ENN_RUN_DIR"]).parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _assert_worker_recorded(run, job: str, task: str) -> None:
    """Rank 0 of `job` (its pid, as its own log names it) took the run lock, recorded the
    job once in jobs.jsonl, and released the lock when it ended."""
    (record,) = [j for j in run.jobs() if j.job_id == job]
    assert (record.kind, record.task, record.world_size, record.nodes) == \
        ("slurm", task, 4, 2), record
    rank0 = (run.logs / f"slurm-{job}-r0" / "rank-0.log").read_text()
    assert "worker rank 0/4 " in rank0 and f" pid {record.pid} " in rank0, rank0[:500]
    assert not run.lock_path.exists()


def test_admin_templates_submitted_by_hand_run_in_the_container(pyxis_cluster, test_image,
                                                                tmp_path):
    """slurm/*.sbatch with ENN_* variables, as an admin submits them, on a run (and a staged
    prediction) made the way `enn-submit train` / `predict` make them before submitting.
    No launcher of ours holds the run lock there: rank 0 takes it, records the job in
    jobs.jsonl (so status and cancel know it) and releases it at the end."""
    from enn_cluster.config.loading import load_config
    from enn_cluster.client.prepare import prepare_run, shape_from_flags

    cluster = pyxis_cluster(1)
    cfg = load_config(str(write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "adm", training={"epochs": 1}))))
    run = prepare_run(cfg, shape_from_flags(cfg, 2, 0, 2))
    # admin.md's CPU-only overrides, as documented (--exclusive=user: test nodes are shared)
    shape = (*documented_cpu_only_flags(), "--exclusive=user")
    env = {"ENN_RUN_DIR": str(run.path), "ENN_IMAGE": str(test_image), "ENN_MAX_RESTARTS": "0"}
    assert run.jobs() == [] and not run.lock_path.exists()
    job = _sbatch_template(cluster, "train.sbatch", env, *shape)
    cluster.wait_job(job, ("COMPLETED",), timeout=240)
    assert _started_in_container(cluster, job)
    assert metrics(run.path, "train")[-1]["step"] == 14
    assert layout.batch_log(run.path, job).is_file()  # the batch log, in the run
    _assert_worker_recorded(run, job, "train")
    status = cli("status", run.path)  # issue 15 item 8: the job came from a template
    assert f"slurm job:       {job} COMPLETED" in status.stdout, status.stdout
    np.save(tmp_path / "x.npy", np.ones((30, 8), np.float32))
    staged = cli("predict", run.path, "--input", tmp_path / "x.npy", "--name", "hand",
                 "--chunk-rows", "10", "--prepare-only")  # admin.md: staging without a job
    assert staged.returncode == 0 and staged.stdout.strip() == "hand", staged.stderr
    job = _sbatch_template(cluster, "predict.sbatch", {**env, "ENN_PREDICT_NAME": "hand"}, *shape)
    if cluster.wait_job(job, ("COMPLETED", "FAILED"), timeout=240) == "FAILED":
        _xfail_if_py3112_metadata(run.path, "predict from a checkpoint written in the container")
    assert cluster.job_state(job)[0] == "COMPLETED"
    _assert_worker_recorded(run, job, "predict")
    got = cli("collect", run.path, "--name", "hand", "--out", tmp_path / "hand.npy")
    assert got.returncode == 0, got.stderr
    assert np.load(tmp_path / "hand.npy").shape[0] == 30


def _podman_leftovers() -> tuple[list[str], list[str]]:
    """(enroot's extraction containers, our build tags) still in podman."""
    names = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True,
                           text=True, check=True).stdout.split()
    tags = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"],
                          capture_output=True, text=True, check=True).stdout.split()
    return ([n for n in names if n.startswith("enroot.")],
            [t for t in tags if t.startswith("localhost/enn-cluster:")])


def test_images_from_enroot_import_and_from_our_writer_both_start(pyxis_cluster, test_image,
                                                                  dev_base_image, tmp_path):
    """The session image came from our writer: the dev base has no CMD, which `enroot
    import` cannot take. The same Dockerfile with a CMD goes through `enroot import` (podman,
    no docker: the shim answers its `docker rm`), exits 0 and leaves nothing in podman.
    That image is cached beside the session image (same key rules), so it is built once."""
    cluster = pyxis_cluster(1)
    dockerfile = IMAGE_CACHE / "Dockerfile.with-cmd"
    dockerfile.write_text((ROOT / "containers/Dockerfile").read_text() + 'CMD ["/bin/sh"]\n')
    before = _podman_leftovers()
    imported, log = build_test_image(IMAGE_CACHE, dev_base_image, dockerfile)
    if "up to date" not in log:  # built now, not by an earlier session
        assert "enn build: enroot import" in log and "no CMD" not in log, log
        assert _podman_leftovers() == before
    last = log.splitlines()[-1]  # the image, its size and the path that made it
    assert f"{imported} (" in last and "made by enroot import" in last, log
    assert imported != test_image
    assert _cat(imported, "etc/environment") == _cat(test_image, "etc/environment")
    probe = "import enn_cluster, torch, os; print(os.uname().nodename, torch.__version__)"
    for image in (test_image, imported):
        proc = cluster.run(["srun", "-N2", "--ntasks-per-node=1", f"--container-image={image}",
                            "--no-container-mount-home", "python3", "-c", probe], timeout=180)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert sorted(line.split()[0] for line in lines) == ["n1", "n2"], proc.stdout
        assert all(line.split()[1].startswith("2.13.0") for line in lines), proc.stdout


def _cat(sqsh: Path, path: str) -> str:
    return subprocess.run(["unsquashfs", "-cat", str(sqsh), path], capture_output=True,
                          text=True, check=True).stdout
