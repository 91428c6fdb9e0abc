"""Small things a new user meets first (issue 26 section 5): a pipe closed early, a command
run before there is anything to act on, a warning on every API call."""
from __future__ import annotations

import subprocess
import sys
import warnings

from helpers import ROOT, cli, small_config, train_tiny, write_config


def test_status_piped_into_a_reader_that_leaves_ends_quietly(tmp_path):
    run = train_tiny(tmp_path, "piped")
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "status", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # `| head -0`
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_commands_before_their_inputs_exist_say_what_to_run_first(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "fresh", parallel={
        "nodes": 1, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "fresh"
    res = cli("collect", run, "--out", tmp_path / "o.npy")
    assert res.returncode == 2 and "no predictions yet" in res.stderr and \
        "enn-submit predict" in res.stderr and "--name" not in res.stderr, res.stderr
    res = cli("export", run, "--out", tmp_path / "art")
    assert res.returncode == 2 and "RUN_DIR:" in res.stderr and "--step" not in res.stderr, \
        res.stderr


def test_loading_a_model_in_one_process_warns_nothing(tmp_path):
    from enn_cluster import Run

    run = train_tiny(tmp_path, "quiet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Run.open(run).load_model()
