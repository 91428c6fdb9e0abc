"""HSDP gradient accumulation keeps the intra-node reduce-scatter and skips only the
inter-node all-reduce until the last micro-batch (model_setup.gradient_sync). On a real
2x2 CPU mesh (4 gloo processes):
- the accumulated gradients equal both the previous path (set_requires_gradient_sync(False):
  no communication until the last micro-batch) and a single-process reference;
- between micro-batches a rank holds only a shard of the gradients, where the previous
  path holds every parameter's unsharded gradient (the memory the change saves);
- parallel.reduce_dtype reaches FSDP2's MixedPrecisionPolicy on every wrapped module."""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.multiprocessing as mp

from helpers import ROOT

ACCUM, MICRO, WORLD = 3, 4, 4


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(WORLD, ACCUM, MICRO, 6, generator=g), torch.randn(WORLD, ACCUM, MICRO, 2, generator=g)


def _fsdp_groups(model):
    from torch.distributed.fsdp import FSDPModule

    def groups(state):  # torch <= 2.9: one group per state; later: a list of them
        many = getattr(state, "_fsdp_param_groups", None)
        return many if many is not None else [g for g in [state._fsdp_param_group] if g]

    return [g for m in model.modules() if isinstance(m, FSDPModule)
            for g in groups(m._get_fsdp_state())]


def _held_gradients(model) -> dict:
    """Gradient elements this rank holds between micro-batches (summed over parameter
    groups). FSDP2 (torch 2.13) keeps HSDP's reduce-scattered, not yet all-reduced shard
    flat in the group (`_partial_reduce_output`) and sets p.grad only after the last
    micro-batch; set_requires_gradient_sync(False) keeps unsharded gradients instead. No
    public API says which: these private fields are the observable."""
    held = {"shard": 0, "partial": 0, "unsharded": 0, "full": 0, "p.grad": 0}
    for group in _fsdp_groups(model):
        held["partial"] += 0 if group._partial_reduce_output is None else \
            group._partial_reduce_output.numel()
        for fp in group.fsdp_params:
            held["shard"] += fp.sharded_size.numel()
            held["full"] += fp.sharded_param.numel()  # a DTensor's numel is the global one
            held["p.grad"] += fp.sharded_param.grad is not None
            acc = fp.unsharded_accumulated_grad
            grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
            held["unsharded"] += sum(t.numel() for t in (acc, grad) if t is not None)
    return held


def _accumulate(sm, rank, sync_fn):
    from enn_cluster.worker.model_setup import gradient_sync

    x, y = _data()
    held = None
    for k in range(ACCUM):
        with (sync_fn(sm, k == ACCUM - 1) if sync_fn else gradient_sync(sm, k == ACCUM - 1)):
            loss = torch.nn.functional.mse_loss(sm.model(x[rank, k]), y[rank, k])
            (loss / ACCUM).backward()
        if k == 0:
            held = _held_gradients(sm.model)
    local = [(tuple(p.grad.to_local().shape), tuple(p.to_local().shape))
             for p in sm.model.parameters()]
    grads = [p.grad.full_tensor().clone() for p in sm.model.parameters()]
    for p in sm.model.parameters():
        p.grad = None
    return grads, held, local


def _old_path(sm, sync):
    from contextlib import nullcontext

    from enn_cluster.worker.model_setup import _communicate

    return nullcontext() if sync else _communicate(sm.model.set_requires_gradient_sync)


def _policies(rank: int, reduce_dtype: str) -> list[str]:
    """Mixed-precision policies on the modules model_setup builds from a config (bf16 on)."""
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.worker.environment import WorkerEnv
    from enn_cluster.worker.lanes import Lanes
    from enn_cluster.worker.model_setup import build_sharded_model

    cfg = config_from_dict({"model": {"name": "mlp", "hidden_sizes": [16, 16]},
                            "training": {"bf16": "true"},
                            "parallel": {"strategy": "hsdp", "reduce_dtype": reduce_dtype}})
    env = WorkerEnv(launcher="local", rank=rank, local_rank=rank % 2, world_size=WORLD,
                    local_world_size=2, node_rank=rank // 2, num_nodes=2,
                    master_addr="localhost", master_port=0)
    lanes = Lanes(control=None, checkpoint=None, device=torch.device("cpu"), rank=rank,
                  world_size=WORLD)
    manifest = {"entries": {"train_y": {"shape": [64, 2]}}}
    sm = build_sharded_model(cfg, manifest, env, lanes, (6,))
    groups = _fsdp_groups(sm.model)
    assert groups and sm.plan.strategy == "hsdp"
    return [f"{g.mp_policy.param_dtype} {g.mp_policy.reduce_dtype}" for g in groups]


def _rank(rank: int, init: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.worker.model_setup import ShardedModel
    from enn_cluster.worker.parallel import build_mesh, wrap_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    plan = MeshPlan("hsdp", 2, 2)
    mesh = build_mesh(plan, torch.device("cpu"))
    sm = ShardedModel(wrap_model(_model(), plan, mesh, torch.device("cpu"), False), plan, mesh,
                      False)
    new, old = _accumulate(sm, rank, None), _accumulate(sm, rank, _old_path)
    policies = {d: _policies(rank, d) for d in ("bf16", "fp32")}
    dist.destroy_process_group()
    torch.save({"new": new, "old": old, "policies": policies}, f"{out}.{rank}")
    # as the worker does (worker.exit_now): interpreter finalisation with a gloo thread
    # still winding down aborted a rank here once ("terminate called without an active
    # exception")
    os._exit(0)


def test_hsdp_accumulation_holds_shards_and_matches_the_reference(tmp_path):
    mp.spawn(_rank, args=(f"file://{tmp_path / 'rdzv'}", str(tmp_path / "out")), nprocs=WORLD,
             join=True)
    ref = copy.deepcopy(_model())
    x, y = _data()
    for r in range(WORLD):
        for k in range(ACCUM):
            loss = torch.nn.functional.mse_loss(ref(x[r, k]), y[r, k])
            (loss / (ACCUM * WORLD)).backward()
    expected = [p.grad for p in ref.parameters()]
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        (new, held, local), (old, held_old, _) = got["new"], got["old"]
        for a, b, want in zip(new, old, expected):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            assert torch.allclose(a, want, rtol=1e-5, atol=1e-6)
        # after a non-final micro-batch: the reduce-scattered shard, nothing unsharded
        assert held["partial"] == held["shard"] < held["full"], held
        assert held["unsharded"] == 0 and held["p.grad"] == 0, held
        # the previous path, for contrast: whole gradients, no shard (what this guards)
        assert held_old["partial"] == 0 and held_old["unsharded"] == held_old["full"], held_old
        assert all(g == s for g, s in local), local  # after the last: p.grad is the shard
        assert set(got["policies"]["bf16"]) == {"torch.bfloat16 torch.bfloat16"}
        assert set(got["policies"]["fp32"]) == {"torch.bfloat16 torch.float32"}
