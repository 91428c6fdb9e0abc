"""Pieces of the training loop that need no process group."""
from __future__ import annotations

import gc

import pytest
import torch

from enn_cluster.worker.step_math import clip_and_norm, scheduled_gc


def test_scheduled_gc_freezes_then_restores():
    assert gc.isenabled()
    with scheduled_gc():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with scheduled_gc():
            raise RuntimeError("training failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_clip_and_norm_matches_torch():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(16, 8) * 10
    for m in (ours, theirs):
        m(x).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0))
    assert float(clip_and_norm(list(ours.parameters()), 1.0)) == pytest.approx(expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(a.grad, b.grad)
    before = [p.grad.clone() for p in ours.parameters()]
    norm = float(clip_and_norm(list(ours.parameters()), float("inf")))  # no clipping, norm only
    assert norm == pytest.approx(1.0, rel=1e-4)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters()))


def test_clip_and_norm_clips_fsdp2_gradients(tmp_path):
    """On DTensor gradients (FSDP2 on a 2-D mesh) the norm is completed once and the clip
    scales the sharded gradients."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        model = copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(32, 8) * 10
        for m in (ref, model):
            m(x).pow(2).sum().backward()
        expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        assert expected > 0.5
        assert float(clip_and_norm(model.parameters(), 0.5)) == pytest.approx(expected, rel=1e-5)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(a.grad.full_tensor(), b.grad, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


SYNC_COUNTER = r"""
import inspect, json, os, sys
import torch
from enn_cluster.worker import trainer as tr
from enn_cluster.worker.entry import run_task

conversions = []
def counting(name):
    original = getattr(torch.Tensor, name)
    def wrapper(self, *a, **k):
        caller = inspect.currentframe().f_back.f_code.co_filename
        if not caller.endswith("lanes.py"):  # the control lane's host tensors are no sync
            conversions.append(f"{name} {os.path.basename(caller)}")
        return original(self, *a, **k)
    setattr(torch.Tensor, name, wrapper)
for name in ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"):
    counting(name)

# A step's window runs from its train_step to the next one's: the loop's own body counts.
starts, log_steps = [], []
original_step = tr.Trainer.train_step
def train_step(self, perm, flags=(), log_step=True):
    starts.append(len(conversions))
    log_steps.append(log_step)
    return original_step(self, perm, flags, log_step)
tr.Trainer.train_step = train_step
original_save = tr.Trainer.save
def save(self, async_save):  # a checkpoint's copies to the host are the save's, not the step's
    before = len(conversions)
    original_save(self, async_save)
    del conversions[before:]
tr.Trainer.save = save
code = run_task(sys.argv[1])
ends = starts[1:] + [len(conversions)]
per_step = [(log, conversions[a:b]) for log, a, b in zip(log_steps, starts, ends)]
print(json.dumps({"code": code, "per_step": per_step}), flush=True)
os._exit(0)  # as the worker leaves (worker.exit_now): no finalisation race with gloo threads
"""


def test_no_device_to_host_read_in_steps_that_do_not_log(tmp_path):
    """Loss, gradient norm and the non-finite decision stay on the device between log
    steps: a step that does not log converts no tensor to a Python value or a host copy,
    neither in train_step nor in the loop around it (checkpoint saves aside)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT, cli, small_config, write_config

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "sync", training={"max_steps": 10}, logging={"every_steps": 5},
        parallel={"nodes": 1, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_PORT=str(_free_port()))
    res = subprocess.run([sys.executable, "-c", SYNC_COUNTER, str(tmp_path / "runs" / "sync")],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and len(out["per_step"]) == 10
    quiet = [len(c) for log_step, c in out["per_step"] if not log_step]
    loud = [len(c) for log_step, c in out["per_step"] if log_step]
    assert quiet == [0] * 8, out["per_step"]
    assert len(loud) == 2 and all(0 < n <= 4 for n in loud), out["per_step"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
