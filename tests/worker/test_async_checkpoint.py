"""Async checkpoints hold the state of the step they were asked at, even when the copy
of the parameters runs late and training goes on meanwhile."""
from __future__ import annotations

import json

import pytest
import torch

from enn_cluster.storage import commits as store
from helpers import cli, full_params, metrics, small_config, write_config


def _train(tmp_path, name: str, async_save: bool, env=None):
    cfg = write_config(tmp_path / f"{name}.yaml", **small_config(
        tmp_path, name, parallel={"nodes": 2, "procs_per_node": 2},
        training={"epochs": 2}, checkpoint={"every_steps": 4, "keep_last": 20,
                                            "async_save": async_save}))
    res = cli("train", "--config", cfg, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / "runs" / name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_checkpoints_equal_sync_ones_when_the_copy_is_late(tmp_path):
    sync = _train(tmp_path, "sync", False)
    late = _train(tmp_path, "late", True, env={"ENN_FAULT_SLOW_STAGING_S": "0.3"})
    steps = store.committed_steps(sync / "checkpoints")
    assert steps == store.committed_steps(late / "checkpoints") and len(steps) >= 5
    assert any(r.get("async_save") for r in metrics(late, "checkpoint"))
    for step in steps:
        a = full_params(store.step_dir(sync / "checkpoints", step))
        b = full_params(store.step_dir(late / "checkpoints", step))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
        trainer = [json.loads((store.step_dir(run / "checkpoints", step) / "trainer.json")
                              .read_text()) for run in (sync, late)]
        assert trainer[0] == trainer[1]
    # the loop went on while the copies were late, and optimizer steps waited for them
    assert max(r.get("checkpoint_wait_s", 0) for r in metrics(late, "train")) > 0.1
    assert not any("checkpoint_wait_s" in r for r in metrics(sync, "train"))
    assert cli("verify", late).returncode == 0
