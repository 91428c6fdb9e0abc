"""Staging under hostile conditions: a full filesystem is reported (ENOSPC, not SIGBUS)
with nothing left behind, SIGTERM while staging removes the temporary run directory, a
FIFO or device given as an input or config is refused instead of blocking forever."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from helpers import ROOT, cli, small_config
from test_storage_faults import small_fs  # noqa: F401  (fixture: a 9 MiB tmpfs)


def _inputs(tmp_path, rows):
    x, y = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(x, np.zeros((rows, 32), np.float32))
    np.save(y, np.zeros((rows, 1), np.float32))
    return x, y


def test_full_filesystem_while_staging_is_one_line_and_leaves_nothing(tmp_path, small_fs):
    x, y = _inputs(tmp_path, 100_000)  # 12.8 MB of inputs onto a 9 MiB filesystem
    cfg = small_config(tmp_path, "full", data={"train_path": str(x), "train_targets_path": str(y)},
                       parallel={"nodes": 1, "procs_per_node": 1})
    cfg["runs_root"] = str(small_fs)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    done = cli("train", "--config", tmp_path / "c.yaml")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines()[-1].startswith(
        "enn-submit: error: runs_root: no space left in ")
    assert "Traceback" not in done.stderr
    assert os.listdir(small_fs) == []


def test_sigterm_while_staging_removes_the_temporary_run_dir(tmp_path):
    """The process signals itself half-way through populating the new run directory."""
    cfg = small_config(tmp_path, "term")
    script = textwrap.dedent(f"""
        import os, signal, time
        from enn_cluster.config.loading import config_from_dict
        from enn_cluster.storage.rundir import create_run_dir
        def populate(tmp):
            (tmp.data_dir / "train_x.npy").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        create_run_dir(config_from_dict({cfg!r}), populate)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    assert not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == []


@pytest.mark.parametrize("kind", ["fifo", "dir", "device"])
@pytest.mark.parametrize("where", ["data.train_path", "--config"])
def test_input_that_is_not_a_regular_file_is_refused(tmp_path, kind, where):
    name = "in.npy" if where != "--config" else "c.yaml"
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path = "/dev/zero" if where == "--config" else tmp_path / "zero.npy"
        if where != "--config":
            os.symlink("/dev/zero", path)
    if where == "--config":
        args = ["train", "--config", path]
    else:
        cfg = small_config(tmp_path, "fifo", data={"train_path": str(path),
                                                   "train_targets_path": str(path)})
        (tmp_path / "ok.yaml").write_text(yaml.safe_dump(cfg))
        args = ["train", "--config", tmp_path / "ok.yaml"]
    done = cli(*args, timeout=60)
    assert done.returncode == 2, done.stderr[-1000:]
    assert done.stderr.strip().count("\n") == 0 and where in done.stderr
    assert not (tmp_path / "runs").exists()
