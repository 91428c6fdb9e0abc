"""What a Slurm job carries from the login node and checks on the node (issue 25 item 7):
the submitting enn_cluster's identity (a worker running other code refuses in one line),
the submitter's ENN_NCCL_PROFILE, a run directory in the login node's memory refused,
and the worker's own defaults (allocator, caches where HOME is missing)."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.job_script import env_lines
from enn_cluster.cluster.submit_slurm import filesystem_type, node_local_problem
from enn_cluster.worker.exec_env import process_defaults
from enn_cluster.worker.code_identity import code_identity, skew_problem
from helpers import ROOT, cli, small_config, write_config


def test_code_identity_is_the_version_and_a_hash_of_the_code():
    import enn_cluster

    here = code_identity()
    assert here.startswith(f"{enn_cluster.__version__}+") and len(here.split("+")[1]) == 12
    assert code_identity() == here  # stable
    assert skew_problem(None, here) is None and skew_problem(here, here) is None
    line = skew_problem("0.1.0+000000000000", here)
    assert line.startswith(f"enn_cluster version skew: submitted with 0.1.0+000000000000, "
                           f"the job runs {here}; rebuild the image")


def test_a_worker_running_other_code_than_was_submitted_refuses_in_one_line(tmp_path):
    """The submitit entry with another identity: exit 2 before anything is read or
    started, one line naming both identities."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "skew"))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "skew"
    code = ("import sys; from enn_cluster.worker.slurm_entry import worker_entry; "
            "worker_entry(sys.argv[1], 'train', None, None, '0.0.1+deadbeefdead')")
    res = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "submitted with 0.0.1+deadbeefdead, the job runs " + code_identity() in line, line
    assert not (run / "metrics.jsonl").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_skewed_rank_of_a_slurm_job_is_the_one_line_its_peers_and_logs_point_at(tmp_path):
    """Issue 40 section 1: two tasks of Slurm job 41 (its environment, no srun). Rank 0
    refuses the skewed code and records requeue/refused-41; rank 1 then waits at the
    rendezvous for rank 0 in vain. It leaves in one line naming the refusal, exit 1, with
    no traceback in the batch log (its own failure goes to its rank log), and `logs
    --rank 0`, with no log of rank 0 to show, names the refusal and the batch log."""
    from enn_cluster.storage import layout, node_loss
    from enn_cluster.storage.job_record import JobRecord
    from enn_cluster.storage.rundir import RunDir

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "skew", parallel={"nodes": 1, "procs_per_node": 2, "rendezvous_timeout_s": 3}))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "skew"
    RunDir(run).record_job(JobRecord(kind="slurm", job_id="41"))  # as the submitter records the job
    layout.batch_log(run, "41").parent.mkdir(exist_ok=True)
    layout.batch_log(run, "41").write_text("enn: job 41 restart 0 on n1\n")
    (run / "requeue").mkdir(exist_ok=True)  # the batch shell makes it
    slurm = {"SLURM_JOB_ID": "41", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}

    def task(rank: int, submitted: str) -> subprocess.CompletedProcess:
        code = ("import sys; from enn_cluster.worker.slurm_entry import worker_entry; "
                "worker_entry(sys.argv[1], 'train', None, None, sys.argv[2])")
        return subprocess.run([sys.executable, "-c", code, str(run), submitted],
                              capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, **slurm, SLURM_PROCID=str(rank),
                                       SLURM_LOCALID=str(rank)))

    refused = task(0, "0.0.1+deadbeefdead")
    assert refused.returncode == 2, refused.stderr
    skew = f"submitted with 0.0.1+deadbeefdead, the job runs {code_identity()}"
    assert skew in (run / "requeue" / "refused-41").read_text()
    peer = task(1, code_identity())
    assert peer.returncode == 1, peer.stderr
    assert "Traceback" not in peer.stderr, peer.stderr
    note = node_loss.read_refusal(run, "41")
    assert note.startswith(f"enn_cluster version skew: {skew}; rebuild the image"), note
    assert f"enn_cluster worker: leaving: another rank of job 41 refused its input: {note}" \
        in peer.stderr.splitlines(), peer.stderr
    rank_log = (run / "logs" / "slurm-41-r0" / "rank-1.log").read_text()
    assert "this rank's own failure, after another rank refused:" in rank_log
    assert "Traceback" in rank_log, rank_log[-2000:]  # kept where the rank's detail lives
    # srun's --kill-on-bad-exit stops a peer that is still starting: it leaves at once, in
    # the same one line, where another job's (or no) refusal leaves the signal remembered
    stopped = ("import os, signal, sys, time; from enn_cluster.worker.entry import "
               "install_early_stop_handlers, _early_signals; install_early_stop_handlers("
               "sys.argv[1], sys.argv[2]); os.kill(os.getpid(), signal.SIGTERM); "
               "time.sleep(0.2); print('remembered', _early_signals)")
    for job, code, said in (("41", 1, f"another rank of job 41 refused its input: {note}"),
                            ("42", 0, "remembered [15]")):
        res = subprocess.run([sys.executable, "-c", stopped, str(run), job], timeout=120,
                             capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert res.returncode == code and said in res.stdout + res.stderr, res
    logs = cli("logs", run, "--rank", "0")  # rank 1 made the attempt's folder, rank 0 none
    assert logs.returncode == 2 and "--rank 0: no log at" in logs.stderr, logs.stderr
    (run / "logs" / "slurm-41-r0" / "rank-1.log").unlink()
    (run / "logs" / "slurm-41-r0" / "exit-rank-1.json").unlink(missing_ok=True)
    (run / "logs" / "slurm-41-r0").rmdir()
    logs = cli("logs", run, "--rank", "0")
    assert logs.returncode == 2, logs.stderr
    from enn_cluster.client.doctor import check_logs  # doctor's logs layer, the job over

    found = check_logs(RunDir(run), live=False, q=str(run))
    assert (found.level, found.detail) == \
        ("problem", f"job 41 refused its input (not requeued): {note}"), found
    assert logs.stderr.strip().splitlines()[-1].endswith(
        f"{run}: no logs yet: job 41 refused its input (not requeued): {note}; its batch "
        f"log: {layout.batch_log(run, '41')}"), logs.stderr


def test_submit_hands_the_job_this_code_identity(tmp_path):
    """Through the real submit path, sbatch a stub: the pickled call submitit hands the
    job ends with this enn_cluster's identity."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", 'echo "Submitted batch job 4242"'),
                       ("squeue", "exit 0"), ("sacct", "exit 0"), ("scontrol", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "ident"))
    res = cli("train", "--config", cfg, "--cluster", "slurm", "--container", "none",
              "--time", "10", "--nodes", "1", "--procs-per-node", "1",
              env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr
    (pkl,) = (tmp_path / "runs" / "ident" / "slurm").rglob("*_submitted.pkl")
    with open(pkl, "rb") as fh:
        delayed = pickle.load(fh)
    assert delayed.args[-1] == code_identity()
    assert delayed.function.__name__ == "worker_entry"


def _nccl_block(spec: JobSpec, environ: dict) -> dict:
    script = "\n".join(["set -eu", *env_lines(spec), "env"])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **environ})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_the_submitters_nccl_profile_wins_and_brings_no_other_profiles_defaults():
    spec = JobSpec(job_name="j", run_dir="/r", nccl_profile="efa")
    site = _nccl_block(spec, {})
    assert site["ENN_NCCL_PROFILE"] == "efa" and site["FI_PROVIDER"] == "efa"
    mine = _nccl_block(spec, {"ENN_NCCL_PROFILE": "socket"})
    assert mine["ENN_NCCL_PROFILE"] == "socket"
    assert "FI_PROVIDER" not in mine  # the worker sets socket's own on the node


MOUNTS = ("/dev/sda1 / ext4 rw 0 0\n"
          "tmpfs /tmp tmpfs rw,nosuid 0 0\n"
          "tmpfs /dev/shm tmpfs rw 0 0\n"
          "fs1:/export /shared nfs4 rw 0 0\n"
          "/dev/md0 /shared/local\\040disk xfs rw 0 0\n"
          "lustre@o2ib:/scratch /scratch lustre rw 0 0\n")


def test_the_filesystem_holding_a_run_directory():
    assert filesystem_type(Path("/shared/runs/a"), MOUNTS) == "nfs4"
    assert filesystem_type(Path("/shared/local disk/x"), MOUNTS) == "xfs"
    assert filesystem_type(Path("/sharedx/y"), MOUNTS) == "ext4"  # not under /shared
    assert filesystem_type(Path("/tmp"), MOUNTS) == "tmpfs"
    assert filesystem_type(Path("/scratch/u/runs"), MOUNTS) == "lustre"
    assert filesystem_type(Path("/x"), "") is None


def test_a_run_directory_in_memory_is_refused_naming_the_filesystem():
    line = node_local_problem(Path("/tmp/runs/a"), MOUNTS)
    assert line.startswith("runs_root: the run directory /tmp/runs/a is on tmpfs")
    assert "shared filesystem" in line
    assert node_local_problem(Path("/dev/shm/r"), MOUNTS).startswith("runs_root:")
    for shared in ("/shared/runs/a", "/scratch/r", "/home/u/runs"):
        assert node_local_problem(Path(shared), MOUNTS) is None


def test_worker_defaults_allocator_and_caches_where_home_is_missing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = process_defaults({"HOME": str(home), "TMPDIR": str(tmp_path)}, uid=7)
    assert out == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert process_defaults({"HOME": str(home), "PYTORCH_CUDA_ALLOC_CONF": "backend:native"}) == {}
    assert process_defaults({"HOME": str(home), "PYTORCH_ALLOC_CONF": "x:y"}) == {}
    missing = process_defaults({"HOME": "/home/nobody-here", "TMPDIR": str(tmp_path),
                                "TRITON_CACHE_DIR": "/mine"}, uid=7)
    assert missing["HOME"] == f"{tmp_path}/enn-cache-7"
    assert missing["XDG_CACHE_HOME"] == f"{tmp_path}/enn-cache-7/xdg"
    assert missing["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/enn-cache-7/inductor"
    assert "TRITON_CACHE_DIR" not in missing and "TMPDIR" not in missing  # the user's kept
    assert process_defaults({}, uid=3)["HOME"] == "/tmp/enn-cache-3"
    # issue 39: a site's per-job TMPDIR that the container's read-only root lacks
    site = process_defaults({"HOME": "/home/nobody-here", "TMPDIR": "/local/job-9"}, uid=7)
    assert (site["TMPDIR"], site["HOME"]) == ("/tmp", "/tmp/enn-cache-7")
    kept_home = process_defaults({"HOME": str(home), "TMPDIR": "/local/job-9"}, uid=7)
    assert kept_home["TMPDIR"] == "/tmp" and "HOME" not in kept_home


def test_a_worker_whose_home_is_missing_trains_with_caches_in_scratch(tmp_path):
    """As under `--no-container-mount-home` with an image that lacks the host's HOME: the
    worker makes $TMPDIR/enn-cache-UID its HOME, says so in its log, and trains."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "nohome", training={"max_steps": 2}, parallel={"nodes": 1, "procs_per_node": 1}))
    scratch = tmp_path / "node-scratch"
    scratch.mkdir()
    res = cli("train", "--config", cfg,
              env={"HOME": str(tmp_path / "no-such-home"), "TMPDIR": str(scratch)})
    assert res.returncode == 0, res.stderr[-2000:]
    home = scratch / f"enn-cache-{os.getuid()}"
    assert home.is_dir() and not (tmp_path / "no-such-home").exists()
    (log,) = (tmp_path / "runs" / "nohome" / "logs").rglob("rank-0.log")
    assert f"HOME is not a writable directory here: HOME and caches under {home}" in log.read_text()


@pytest.mark.slurm
@pytest.mark.podman
@pytest.mark.slow
def test_an_image_holding_other_code_is_refused_through_pyxis(pyxis_cluster, test_image,
                                                              tmp_path):
    """Issue 25 item 7 through the real Pyxis path: the login node's enn_cluster (a copy of
    this checkout with one file changed) submits into the image of this checkout. Every
    task in the container refuses with the one line naming both identities, exit 2: the job
    ends without a requeue or retry, and nothing is trained."""
    cluster = pyxis_cluster(0)
    login = tmp_path / "login"
    shutil.copytree(ROOT / "enn_cluster", login / "enn_cluster",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(login / "enn_cluster" / "errors.py", "a") as fh:
        fh.write("# the login node's edit that the image does not have\n")
    submitted = subprocess.run(
        [sys.executable, "-c", "from enn_cluster.worker.code_identity import code_identity; "
         "print(code_identity())"], capture_output=True, text=True, cwd=login, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(login))).stdout.strip()
    assert submitted and submitted != code_identity()
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "skewed"))
    res = subprocess.run(  # enn-submit as the login node's copy runs it
        [sys.executable, "-m", "enn_cluster.client.cli", "train", "--config", str(cfg),
         "--cluster", "slurm", "--container", str(test_image), "--time", "10", "--nodes", "1",
         "--gpus-per-node", "2"], capture_output=True, text=True, timeout=180, cwd=login,
        env=dict(os.environ, PYTHONPATH=str(login)))
    assert res.returncode == 0, res.stderr[-3000:]
    job = res.stdout.strip().splitlines()[-1]
    run = tmp_path / "runs" / "skewed"
    state = cluster.wait_job(job, ("FAILED", "COMPLETED"), timeout=300)
    _, text = cluster.job_state(job)
    assert "Restarts=0" in text, text
    logs = "".join(p.read_text(errors="replace") for p in (run / "slurm").rglob("*_log.*"))
    line = f"enn_cluster version skew: submitted with {submitted}, the job runs {code_identity()}"
    assert line in logs, logs[-3000:]
    assert "requeueing" not in logs.replace("not requeueing", ""), logs[-3000:]
    assert not (run / "metrics.jsonl").exists(), state
    # issue 40: no rank's traceback buries the line, and where an operator looks next names it
    assert "Traceback" not in logs, logs[-3000:]
    status = cli("status", run, timeout=60)
    assert f"refused:         job {job} refused its input and was not requeued: {line}" \
        in status.stdout, status.stdout
    doctor = cli("doctor", run, timeout=120)
    assert doctor.returncode == 1 and f"job {job} refused its input (not requeued): {line}" \
        in doctor.stdout, doctor.stdout
    shown = cli("logs", run, "--rank", "0", timeout=60)
    assert shown.returncode == 2 and f"no logs yet: job {job} refused its input (not " \
        f"requeued): {line}" in shown.stderr, shown.stderr


def test_workers_start_where_the_site_s_tmpdir_and_home_do_not_exist(tmp_path):
    """A real run whose TMPDIR and HOME name paths that do not exist on this node (a site's
    per-job TMPDIR on the host, a HOME the image lacks): every worker starts, says once
    where temporary files and caches went, and the run trains."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "tmpdir", training={"max_steps": 2}, parallel={"nodes": 1, "procs_per_node": 2}))
    gone = tmp_path / "not-here"
    res = cli("train", "--config", cfg, env={"TMPDIR": str(gone / "job-9"),
                                             "HOME": str(gone / "home")})
    assert res.returncode == 0, res.stderr[-3000:]
    (logs,) = [d for d in (tmp_path / "runs" / "tmpdir" / "logs").iterdir() if d.is_dir()]
    for rank in (0, 1):
        text = (logs / f"rank-{rank}.log").read_text()
        assert f"TMPDIR {gone}/job-9 is not a writable directory here: temporary files go " \
               "to /tmp" in text, text[-2000:]
        assert "HOME and caches under /tmp/enn-cache-" in text, text[-2000:]
    assert not gone.exists()
