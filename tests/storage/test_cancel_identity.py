"""`cancel` signals only a proven launcher or a Slurm job of the run; a lock that does not
parse is refused, never taken over. The test that lets `cancel` send signals runs in its
own PID namespace (unshare), so a bug there can never reach a process of this machine."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from enn_cluster.errors import UserError
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.process_identity import boot_id, identity, launcher_problem, own_identity
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, read_lock
from enn_cluster.cluster.slurm import job_belongs_to_run
from enn_cluster.storage.run_lock import run_identity as submission_comment
from helpers import ROOT

ME = own_identity()


def _ident(pid):
    return {"start_ticks": ME["start_ticks"], "cmdline_sha256": ME["cmdline_sha256"]} \
        if pid == ME["pid"] else None


@pytest.mark.parametrize("change, expect", [
    ({}, None),
    ({"pid": -1}, "not a launcher"), ({"pid": 0}, "not a launcher"),
    ({"pid": 1}, "not running"), ({"pid": "123"}, "not a launcher"),
    ({"pid": True}, "not a launcher"), ({"host": "elsewhere"}, "host 'elsewhere'"),
    ({"boot_id": "x"}, "booted"), ({"boot_id": None}, "booted"),
    ({"start_ticks": ME["start_ticks"] + 1}, "start differs"),
    ({"start_ticks": None}, "start differs"),
    ({"cmdline_sha256": "0" * 64}, "cmdline differs"),
    ({"pid": ME["pid"] + 1}, "not running"),
])
def test_launcher_proof_needs_every_field(change, expect):
    why = launcher_problem({**ME, **change}, ME["host"], ME["boot_id"], _ident)
    assert why == expect if expect in (None, "not running") else expect in why


def test_own_identity_is_what_proc_says():
    assert ME["boot_id"] == boot_id() and ME["boot_id"]
    assert identity(os.getpid()) == {k: ME[k] for k in ("start_ticks", "cmdline_sha256")}
    assert identity(2 ** 22 + 7) is None


def _stub_slurm(bin_dir, squeue_line: str):
    """squeue answering one job line, scancel recording what it was asked to cancel: the
    Slurm side of `cancel`, whose own check (not Slurm) is what these tests are about."""
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho {shlex.quote(squeue_line)}\n")
    (bin_dir / "scancel").write_text('#!/bin/sh\necho "$@" >> "$0.called"\n')
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir / "scancel.called"


@pytest.mark.parametrize("record, comment_of, cancelled", [
    # a record copied from squeue: the job's real id and name, paths in the run, no comment
    ({"job_id": "77", "job_name": "enn-r"}, None, False),
    # another run's genuine record and job: its comment binds the other run's path
    ({"job_id": "77", "job_name": "enn-r"}, "other", False),
    ({"job_id": "77", "job_name": "enn-r"}, "run", True),
])
def test_cancel_scancels_only_a_job_our_submission_marked(tmp_path, record, comment_of,
                                                          cancelled):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config_path.write_text("run_name: r\n")
    (tmp_path / "other").mkdir()
    comment = submission_comment(tmp_path / comment_of) if comment_of else "(null)"
    called = _stub_slurm(tmp_path / "bin", f"77|PENDING|Priority|0||1|N/A|{comment}|")
    run.record_job(JobRecord(kind="slurm", **record))
    run.lock_path.write_text(json.dumps({"slurm_job_id": "77", "host": "slurm", "pid": 0}))
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    done = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "cancel",
                           str(run.path)], capture_output=True, text=True, env=env, cwd=ROOT)
    if cancelled:
        assert done.returncode == 0 and called.read_text() == "77\n", done.stderr
        assert not run.lock_path.exists(), "the cancelled job's lock stays behind"
        assert not list(run.path.glob(".run.lock*"))
    else:
        assert done.returncode == 2 and not called.exists(), done.stderr
        assert "not proven this run's" in done.stderr and done.stderr.count("\n") == 1
        assert run.lock_path.exists()


def test_submission_comment_binds_the_runs_real_path(tmp_path):
    from enn_cluster.cluster.job_spec import JobSpec
    from enn_cluster.cluster.job_script import submitit_parameters

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "a")
    c = submission_comment(tmp_path / "a")
    assert c == submission_comment(tmp_path / "l")  # the real path counts
    assert c != submission_comment(tmp_path / "b")
    assert " " not in c and "|" not in c and len(c) < 80  # one field of squeue's line
    assert job_belongs_to_run({"comment": c}, tmp_path / "a")
    assert not job_belongs_to_run({"comment": c}, tmp_path / "b")
    assert not job_belongs_to_run({}, tmp_path / "a")
    params = submitit_parameters(JobSpec(job_name="j", run_dir=str(tmp_path / "a")))
    assert params["slurm_additional_parameters"]["comment"] == c  # what sbatch gets


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '"pid"', '{"pid": -1, "host": "h"}',
                                  '{"pid": 0, "host": "h"}', '{"pid": "12", "host": "h"}',
                                  '{"pid": 99}', '{"slurm_job_id": "1;rm -rf ~"}', "\xff\xfe"])
def test_lock_that_does_not_parse_is_refused_not_taken(tmp_path, text):
    run = RunDir(tmp_path)
    run.lock_path.write_bytes(text.encode("utf-8", "surrogateescape")
                              if text != "\xff\xfe" else b"\xff\xfe")
    before = run.lock_path.read_bytes()
    with pytest.raises(UserError, match=r"^run.lock: .* does not parse .*remove it \(rm "):
        acquire_lock(run)
    assert run.lock_path.read_bytes() == before


def test_stale_locks_are_taken_over_live_ones_refused(tmp_path):
    run = RunDir(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    for stale in ({**lock_owner(), "pid": int(gone)},
                  {**lock_owner(), "start_ticks": ME["start_ticks"] - 1},  # pid reused
                  {**lock_owner(), "boot_id": "before-reboot"}):
        run.lock_path.write_text(json.dumps(stale))
        mine = acquire_lock(run, {**lock_owner(), "time": 1.0})
        assert read_lock(run) == mine
        run.lock_path.unlink()
    run.lock_path.write_text(json.dumps(lock_owner()))  # this very process: alive
    with pytest.raises(UserError, match="in use by pid"):
        acquire_lock(run, {**lock_owner(), "pid": 2 ** 22 + 9})


# both namespace scripts: the two run directories, and start(code): a process that runs
# `code` (printing one JSON line), then sleeps; (the process, what it printed)
SCRIPT_HEAD = textwrap.dedent("""
    import json, os, shutil, subprocess, sys
    from pathlib import Path
    run, other = Path(sys.argv[1]), Path(sys.argv[2])
    def start(code):
        p = subprocess.Popen([sys.executable, "-c", (
            "import json, sys, time\\n"
            "from pathlib import Path\\n"
            "from enn_cluster.storage.rundir import RunDir\\nfrom enn_cluster.storage.run_lock import acquire_lock, lock_owner\\n"
            + code + "\\ntime.sleep(600)\\n")], stdout=subprocess.PIPE, text=True)
        return p, json.loads(p.stdout.readline())
""")

NAMESPACE_SCRIPT = SCRIPT_HEAD + textwrap.dedent("""
    # the launcher of this run, holding its lock; an unrelated process; another run's launcher
    holder, real = start(f"print(json.dumps(acquire_lock(RunDir(Path({str(run)!r})))), flush=True)")
    bystander, stranger = start("print(json.dumps(lock_owner()), flush=True)")
    elsewhere, theirs = start(f"print(json.dumps(acquire_lock(RunDir(Path({str(other)!r})))), flush=True)")
    procs = {"holder": holder, "bystander": bystander, "elsewhere": elsewhere}
    forged = {"minus_one": {**real, "pid": -1}, "zero": {**real, "pid": 0},
              "init": {**real, "pid": 1}, "str_pid": {**real, "pid": str(real["pid"])},
              "other_host": {**real, "host": "elsewhere"},
              "old_boot": {**real, "boot_id": "0" * 36},
              "no_boot": {k: v for k, v in real.items() if k != "boot_id"},
              "reused": {**real, "start_ticks": real["start_ticks"] + 1},
              "other_cmd": {**real, "cmdline_sha256": "f" * 64}, "list": [real],
              "unrelated_process": stranger, "other_runs_launcher": theirs}
    out = {}
    def cancel(record):
        with open(run / "run.lock", "r+") as fh:  # in place: the holder's inode stays
            fh.truncate(0)
            fh.write(json.dumps(record))
        p = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "cancel", str(run)],
                           capture_output=True, text=True)
        return [p.returncode, p.stdout + p.stderr, {k: v.poll() for k, v in procs.items()}]
    for name, record in forged.items():
        out[name] = cancel(record)
    out["genuine"] = cancel(real)[:2] + [{"holder": holder.wait(timeout=60),
                                          "bystander": bystander.poll(),
                                          "elsewhere": elsewhere.poll()}]
    print(json.dumps(out))
""")


def _in_pid_namespace(tmp_path, script: str) -> dict:
    """Run `script` (args: two run directories it may lock) as PID 1 of a new PID namespace,
    so that nothing it signals can be outside it; its last stdout line, as JSON."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot isolate a test that sends signals")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare --pid is not permitted here: " + probe.stderr.decode()[:80])
    for name in ("run", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("run_name: r\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                           sys.executable, "-c", script, str(tmp_path / "run"),
                           str(tmp_path / "other")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cancel_signals_only_the_proven_launcher_in_a_pid_namespace(tmp_path):
    """A lock copied from /proc of any process (an unrelated sleeper, another run's
    launcher) is refused: only the process holding this run's lock file open is signalled."""
    out = _in_pid_namespace(tmp_path, NAMESPACE_SCRIPT)
    for name, (code, text, alive) in out.items():
        if name == "genuine":
            assert code == 0, text
            assert alive == {"holder": -15, "bystander": None, "elsewhere": None}, text
            continue
        assert code == 2 and set(alive.values()) == {None}, (name, text)
        assert "Traceback" not in text and text.strip().count("\n") == 0, text
        assert text.startswith("enn-submit: error: run.lock:"), text
    assert "does not hold run.lock open" in out["unrelated_process"][1]
    assert "does not hold run.lock open" in out["other_runs_launcher"][1]


LINK_SCRIPT = SCRIPT_HEAD + textwrap.dedent("""
    mine, _ = start(f"print(json.dumps(acquire_lock(RunDir(Path({str(run)!r})))), flush=True)")
    theirs, _ = start(f"print(json.dumps(acquire_lock(RunDir(Path({str(other)!r})))), flush=True)")
    keep = run.parent / "keep"
    os.link(run / "run.lock", keep)  # this run's own lock, set aside (its holder keeps it open)
    def cancel():
        p = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "cancel", str(run)],
                           capture_output=True, text=True)
        return [p.returncode, p.stdout + p.stderr, {"mine": mine.poll(), "theirs": theirs.poll()}]
    out = {}
    os.unlink(run / "run.lock")
    os.link(other / "run.lock", run / "run.lock")
    out["hard_link"] = cancel()
    os.unlink(run / "run.lock")
    os.symlink(other / "run.lock", run / "run.lock")
    out["symlink"] = cancel()
    os.unlink(run / "run.lock")
    shutil.copy2(other / "run.lock", run / "run.lock")
    out["copy"] = cancel()
    os.unlink(run / "run.lock")
    os.rename(keep, run / "run.lock")
    subprocess.run(["mount", "--bind", str(other), str(run)], check=True)  # this namespace only
    out["bind_mount"] = cancel()
    subprocess.run(["umount", str(run)], check=True)
    out["genuine"] = cancel()[:2] + [{"mine": mine.wait(timeout=60), "theirs": theirs.poll()}]
    theirs.kill()
    print(json.dumps(out))
""")


def test_cancel_never_signals_through_another_runs_lock_in_a_pid_namespace(tmp_path):
    """Issue 38 section 1: another live run's lock file hard-linked, symlinked, copied or
    bind-mounted where this run's lock is: `cancel` signals neither run (the file must be
    this run's own, one link and no symlink, and name this run); the genuine lock still
    stops its launcher."""
    out = _in_pid_namespace(tmp_path, LINK_SCRIPT)
    for name in ("hard_link", "symlink", "copy", "bind_mount"):
        code, text, alive = out[name]
        assert code == 2 and set(alive.values()) == {None}, (name, text, alive)
        assert "Traceback" not in text and text.strip().count("\n") == 0, (name, text)
        assert text.startswith("enn-submit: error: run.lock"), (name, text)
    assert "links" in out["hard_link"][1] and "names another run" in out["bind_mount"][1]
    code, text, alive = out["genuine"]
    assert code == 0 and alive == {"mine": -15, "theirs": None}, text


def test_a_launcher_that_is_pid_1_trains_and_the_run_resumes(tmp_path):
    """Issue 37 section 5: `enn-submit train` as a container's entrypoint (PID 1 of its own
    namespace): its lock is legitimate (the workers refused it, exit 2, and left it stale),
    and a resume afterwards takes the run over."""
    from helpers import cli, small_config, write_config

    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot start a launcher as PID 1")
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "init", training={"max_steps": 2}, checkpoint={"every_steps": 2},
        parallel={"nodes": 1, "procs_per_node": 1}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                           sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                           str(cfg)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    if "unshare failed" in done.stderr or "Operation not permitted" in done.stderr:
        pytest.skip("unshare --pid is not permitted here: " + done.stderr[:80])
    assert done.returncode == 0, done.stderr[-3000:]
    res = cli("resume", tmp_path / "runs" / "init", "--set", "training.max_steps=4")
    assert res.returncode == 0, res.stderr[-3000:]
