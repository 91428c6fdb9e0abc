"""`cancel` signals only a proven launcher or a Slurm job of the run; a lock that does not
parse is refused, never taken over. The test that lets `cancel` send signals runs in its
own PID namespace (unshare), so a bug there can never reach a process of this machine."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from enn_cluster.errors import UserError
from enn_cluster.storage.process_identity import boot_id, identity, launcher_problem, own_identity
from enn_cluster.storage.rundir import RunDir, acquire_lock, lock_owner, read_lock
from enn_cluster.storage.slurm_jobs import job_belongs_to_run, parse_scontrol
from helpers import ROOT

ME = own_identity()


def _ident(pid):
    return {"start_ticks": ME["start_ticks"], "cmdline_sha256": ME["cmdline_sha256"]} \
        if pid == ME["pid"] else None


@pytest.mark.parametrize("change, expect", [
    ({}, None),
    ({"pid": -1}, "not a launcher"), ({"pid": 0}, "not a launcher"),
    ({"pid": 1}, "not a launcher"), ({"pid": "123"}, "not a launcher"),
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


SCONTROL = ("JobId=41 JobName={name} UserId=u(1) Command={cmd} WorkDir={wd} "
            "StdOut={out} Comment={comment}")


@pytest.mark.parametrize("name, cmd, wd, out, comment, names, belongs", [
    ("enn-r", "/runs/r/slurm/41/s.sh", "/home/u", "/runs/r/slurm/41/o", "(null)", set(), True),
    ("x", "/bin/job.sh", "/runs/r", "/tmp/o", "(null)", set(), True),
    ("x", "/bin/job.sh", "/tmp", "/tmp/o", "/runs/r", set(), True),
    ("enn-r", "/bin/job.sh", "/tmp", "/tmp/o", "(null)", {"enn-r"}, True),
    ("enn-r", "/bin/job.sh", "/tmp", "/tmp/o", "(null)", set(), False),
    ("other", "/runs/r2/s.sh", "/runs/rr", "/runs/r-x/o", "/runs", {"enn-r"}, False),
])
def test_slurm_job_must_match_the_run(name, cmd, wd, out, comment, names, belongs):
    fields = parse_scontrol(SCONTROL.format(name=name, cmd=cmd, wd=wd, out=out, comment=comment))
    assert job_belongs_to_run(fields, "/runs/r", names) is belongs
    assert job_belongs_to_run({}, "/runs/r", names) is False


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


NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    run = Path(sys.argv[1])
    victim = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time\\n"
        "from enn_cluster.storage.rundir import lock_owner\\n"
        "print(json.dumps(lock_owner()), flush=True)\\n"
        "time.sleep(600)\\n")], stdout=subprocess.PIPE, text=True)
    real = json.loads(victim.stdout.readline())
    forged = {"minus_one": {**real, "pid": -1}, "zero": {**real, "pid": 0},
              "init": {**real, "pid": 1}, "str_pid": {**real, "pid": str(real["pid"])},
              "other_host": {**real, "host": "elsewhere"},
              "old_boot": {**real, "boot_id": "0" * 36},
              "no_boot": {k: v for k, v in real.items() if k != "boot_id"},
              "reused": {**real, "start_ticks": real["start_ticks"] + 1},
              "other_cmd": {**real, "cmdline_sha256": "f" * 64}, "list": [real]}
    out = {}
    def cancel(record):
        (run / "run.lock").write_text(json.dumps(record))
        p = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "cancel", str(run)],
                           capture_output=True, text=True)
        return [p.returncode, p.stdout + p.stderr, victim.poll()]
    for name, record in forged.items():
        out[name] = cancel(record)
    out["genuine"] = cancel(real)[:2] + [victim.wait(timeout=60)]
    print(json.dumps(out))
""")


def test_cancel_signals_only_the_proven_launcher_in_a_pid_namespace(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot isolate a test that sends signals")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare --pid is not permitted here: " + probe.stderr.decode()[:80])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("run_name: r\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                           sys.executable, "-c", NAMESPACE_SCRIPT, str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (code, text, victim) in out.items():
        if name == "genuine":
            assert (code, victim) == (0, -15), text
            continue
        assert code == 2 and victim is None, (name, text)
        assert "Traceback" not in text and text.strip().count("\n") == 0, text
        assert text.startswith("enn-submit: error: run.lock:"), text
