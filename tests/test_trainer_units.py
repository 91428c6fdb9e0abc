"""Pieces of the training loop that need no process group."""
from __future__ import annotations

import gc

import pytest
import torch

from enn_cluster.trainer import clip_and_norm, scheduled_gc


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
    assert clip_and_norm(list(ours.parameters()), 1.0) == pytest.approx(expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(a.grad, b.grad)
    before = [p.grad.clone() for p in ours.parameters()]
    norm = clip_and_norm(list(ours.parameters()), float("inf"))  # no clipping, norm only
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
        assert clip_and_norm(model.parameters(), 0.5) == pytest.approx(expected, rel=1e-5)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(a.grad.full_tensor(), b.grad, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()
