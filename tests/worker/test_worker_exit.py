"""How `python -m enn_cluster.worker` leaves when its task fails with an error of no known
kind (a peer died mid-collective, a collective timed out): the traceback on stderr, exit 1,
and no interpreter finalisation, as on success (entry.exit_now). Finalisation took a
survivor of a killed rank about a second on 2 cores (and can abort on a gloo thread still
winding down), which the local launcher's restart waited for (bench/README, recovery)."""
from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

SCRIPT = r"""
import atexit, sys
from enn_cluster.worker import entry

def failing(*args, **kwargs):
    raise RuntimeError("Connection closed by peer [127.0.0.1]:3261")

entry.run_entry = failing  # what a survivor's step raises when a peer dies
atexit.register(lambda: open(sys.argv[1], "w").write("finalised"))
entry.exit_now(entry.main(["/nonexistent-run"]))
"""


def _fails_without_finalisation(script: str, tmp_path) -> None:
    """`script` run with a marker path that an atexit handler writes: exit 1 with the
    traceback, and no marker (the interpreter did not finalise)."""
    marker = tmp_path / "finalised"
    res = subprocess.run([sys.executable, "-c", script, str(marker)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" in res.stderr and "RuntimeError: Connection closed by peer" in res.stderr
    assert not marker.exists()  # atexit handlers ran: the interpreter finalised


def test_a_failed_task_prints_its_traceback_and_exits_1_without_finalisation(tmp_path):
    _fails_without_finalisation(SCRIPT, tmp_path)


SUBMITIT = r"""
import atexit, sys
from enn_cluster.worker import entry
from enn_cluster.worker.slurm_entry import worker_entry

def failing(*args, **kwargs):
    raise RuntimeError("Connection closed by peer [10.214.0.13]:49852")

entry.run_entry = failing  # what a survivor's step raises when a node is lost
atexit.register(lambda: open(sys.argv[1], "w").write("finalised"))
worker_entry("/nonexistent-run", "train", None, None)  # as submitit's process_job calls it
"""


def test_a_failed_slurm_task_leaves_without_finalisation_too(tmp_path):
    """The submitit entry (slurm_entry.worker_entry) raises the error for submitit to record,
    then leaves the same way: a lost node's survivors end at once, and the batch shell's
    relaunch (host_setup.sh), which waits for their end, starts sooner."""
    _fails_without_finalisation(SUBMITIT, tmp_path)
