"""A damaged newest checkpoint is skipped, never silently (issue 38 section 5): with step-8
damaged (a truncated shard, a directory in place of a shard), predict, export and resume
use step-4 and say so in their last line, naming the step used, the step skipped and why.
A real 1-rank MLP run (the default model) with two committed steps, copied per case."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from helpers import cli, metrics, small_config, write_config

SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fallback")
    cfg = small_config(tmp, "two", training={"max_steps": 8},
                       checkpoint={"every_steps": 4, "keep_last": 5},
                       parallel={"nodes": 1, "procs_per_node": 1})
    res = cli("train", "--config", write_config(tmp / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp / "runs" / "two"
    assert (run / "checkpoints" / "step-4").is_dir() and (run / "checkpoints" / "step-8").is_dir()
    return run


def _damaged(trained, tmp_path, damage: str):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    shard = run / "checkpoints" / "step-8" / SHARD
    if damage == "truncated":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
    else:
        shard.unlink()
        shard.mkdir()
    return run


WHY = {"truncated": "size", "directory": "directory"}


def _last_line(res, damage: str) -> str:
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "step-4 used" in last and "step-8" in last and SHARD in last, res.stderr[-3000:]
    assert WHY[damage] in last, last
    return last


@pytest.mark.parametrize("damage", ["truncated", "directory"])
def test_predict_export_and_resume_name_the_step_skipped(trained, tmp_path, damage):
    run = _damaged(trained, tmp_path, damage)
    x = np.random.default_rng(1).standard_normal((10, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = cli("predict", run, "--input", tmp_path / "x.npy", "--name", "p")
    _last_line(res, damage)
    assert res.stdout.strip() == "p"

    res = cli("export", run, "--out", tmp_path / "art")
    _last_line(res, damage)
    assert res.stdout.strip() == str(tmp_path / "art")

    res = cli("resume", run)
    _last_line(res, damage)
    assert metrics(run, "resume")[-1]["step"] == 4


def test_an_undamaged_run_says_nothing_more(trained, tmp_path):
    res = cli("export", trained, "--out", tmp_path / "art")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1].startswith("exported to"), res.stderr


def test_the_line_names_every_newer_step_and_only_those():
    from enn_cluster.storage.step_choice import fallback_line

    assert fallback_line(8, {}) is None
    assert fallback_line(None, {8: ["x"]}) is None  # nothing used: the refusal says it
    line = fallback_line(4, {12: ["commit.json: missing"], 8: ["a: size 1, recorded 2"]})
    assert line.startswith("checkpoint step-4 used; skipped the newer step-12 (commit.json")
    assert "step-8 (a: size 1, recorded 2)" in line
