"""Storage faults: a full or read-only checkpoint filesystem gives a clear error, keeps the
previous checkpoints intact, and stops training rather than dropping state silently."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from enn_cluster.storage import commits as store
from helpers import cli, metrics, small_config, write_config


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_fs(tmp_path):
    if not _can_mount():
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: root and mount are needed for storage fault tests")
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _config(tmp_path, name, **training):
    return write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, name, model={"hidden_sizes": [512, 512]},  # ~3.2 MB per checkpoint
        training={"max_steps": 30, **training}, checkpoint={"every_steps": 5, "keep_last": 5},
        parallel={"nodes": 1, "procs_per_node": 2}))


def _checkpoints_on(run, mnt):
    (run / "checkpoints").rmdir()
    (run / "checkpoints").symlink_to(mnt)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_filesystem(tmp_path, small_fs, async_save):
    cfg = _config(tmp_path, "full", max_steps=1)
    assert cli("train", "--config", cfg).returncode == 0  # makes the run (step-1 on disk)
    run = tmp_path / "runs" / "full"
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(small_fs)
    res = cli("resume", run, "--set", "training.max_steps=30",
              "--set", f"checkpoint.async_save={str(async_save).lower()}")
    assert res.returncode != 0
    line = [ln for ln in res.stderr.splitlines() if "training aborted" in ln]
    assert line and "could not be written" in line[0] and "No space left" in line[0], res.stderr[-2000:]
    committed = store.committed_steps(small_fs)
    assert committed[:2] == [5, 10]  # what fitted is complete and verifies
    for step in committed:
        assert store.verify_checkpoint(store.step_dir(small_fs, step)) == []
    assert metrics(run, "train")[-1]["step"] < 30


def test_read_only_filesystem(tmp_path, small_fs):
    cfg = _config(tmp_path, "ro", max_steps=5)
    assert cli("train", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "ro"
    shutil.copytree(run / "checkpoints", small_fs, dirs_exist_ok=True)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(small_fs)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    res = cli("resume", run, "--set", "training.max_steps=12")
    assert res.returncode != 0
    assert "could not be written" in res.stderr and "Read-only file system" in res.stderr, res.stderr[-2000:]
    assert store.committed_steps(small_fs) == [5]
    assert store.verify_checkpoint(store.step_dir(small_fs, 5)) == []
