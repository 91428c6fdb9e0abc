"""StepNorm: a step's gradient norm, clip and loss sum in one all-reduce, from each rank's
local gradient shards, on 4 real gloo processes for each way a model is laid out (HSDP
2x2: each shard held by 2 replicas; FSDP over 4: one copy; DDP: 4 whole copies), compared
with torch's own clip_grad_norm_ on a single-process model that saw every rank's data."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from helpers import ROOT

WORLD, MAX_NORM = 4, 0.5
PLANS = {"hsdp": (2, 2), "fsdp": (1, 4), "ddp": (4, 1)}  # (replicate, shard)
UNEVEN = [2, 4, 6, 8]  # rows each rank holds in the weighted step


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                               torch.nn.Linear(3, 2))


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(WORLD, 8, 6, generator=g) * 4, torch.randn(WORLD, 8, 2, generator=g)


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _one_plan(strategy: str, rank: int) -> dict:
    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.worker.nonfinite import NonFiniteWatch
    from enn_cluster.worker.parallel import build_mesh, wrap_model
    from enn_cluster.worker.step_math import StepNorm

    plan = MeshPlan(strategy, *PLANS[strategy])
    cpu = torch.device("cpu")
    model = wrap_model(_model(), plan, build_mesh(plan, cpu), cpu, False)
    x, y = _data()
    loss = torch.nn.functional.mse_loss(model(x[rank]), y[rank])
    loss.backward()
    watch = NonFiniteWatch(model, cpu, plan.replicate, history=1)
    norm = StepNorm(watch.params, cpu, WORLD)
    shard_norms = norm.shard_norms()
    total, loss_sum = norm.reduce(shard_norms, loss.detach().double(), MAX_NORM)
    out = {"norm": float(total), "loss_sum": float(loss_sum),
           "grads": [_full(p.grad).clone() for p in watch.params],
           "clean_flags": watch.flags(shard_norms).tolist()}
    # a NaN in one element of one shard on the last rank: every rank sees the norm go
    # non-finite (the step is skipped everywhere), only that rank flags that parameter
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x[rank]), y[rank]).backward()
    if rank == WORLD - 1:
        local = watch.params[0].grad
        (local.to_local() if hasattr(local, "to_local") else local).view(-1)[0] = float("nan")
    shard_norms = norm.shard_norms()
    bad_norm, bad_loss = norm.reduce(shard_norms, torch.tensor(1.0, dtype=torch.float64),
                                     MAX_NORM)
    out.update(bad_norm=float(bad_norm), bad_loss=float(bad_loss),
               bad_flags=watch.flags(shard_norms).tolist())
    # uneven ranks: rank r holds 2 + 2r rows (of 8); gradients and loss as sums over its
    # rows, made into the mean over every rank's rows by the count in the same all-reduce
    model.zero_grad(set_to_none=True)
    rows = UNEVEN[rank]
    total_loss = torch.nn.functional.mse_loss(model(x[rank, :rows]), y[rank, :rows],
                                              reduction="sum") / 2  # 2 outputs a row
    total_loss.backward()
    shard_norms = norm.shard_norms()
    w_norm, w_loss = norm.reduce(shard_norms, total_loss.detach().double(), MAX_NORM,
                                 torch.tensor(float(rows)))
    out.update(w_norm=float(w_norm), w_loss=float(w_loss),
               w_grads=[_full(p.grad).clone() for p in watch.params])
    return out


def _rank(rank: int, init: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    results = {s: _one_plan(s, rank) for s in PLANS}
    dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")
    os._exit(0)  # as the worker leaves (worker.exit_now): no race with gloo's threads


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("step_norm")
    mp.spawn(_rank, args=(f"file://{tmp / 'rdzv'}", str(tmp / "out")), nprocs=WORLD,
             join=True)
    return [torch.load(tmp / f"out.{r}", weights_only=True) for r in range(WORLD)]


def _reference():
    """torch's clip_grad_norm_ on one model that averaged every rank's loss, as data
    parallelism does; the loss sum is what the ranks add up."""
    ref = copy.deepcopy(_model())
    x, y = _data()
    losses = [torch.nn.functional.mse_loss(ref(x[r]), y[r]) for r in range(WORLD)]
    (sum(losses) / WORLD).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    return norm, float(sum(l.detach().double() for l in losses)), [
        p.grad for p in ref.parameters()]


@pytest.mark.parametrize("strategy", list(PLANS))
def test_one_all_reduce_gives_torchs_norm_clip_and_the_loss_sum(ranks, strategy):
    norm, loss_sum, grads = _reference()
    assert norm > MAX_NORM * 2  # the clip scales for real
    for got in ranks:
        r = got[strategy]
        assert r["norm"] == pytest.approx(norm, rel=1e-5)
        assert r["loss_sum"] == pytest.approx(loss_sum, rel=1e-9)
        for a, want in zip(r["grads"], grads):
            assert torch.allclose(a, want, rtol=1e-5, atol=1e-7)
        assert r["clean_flags"] == [0] * len(grads)


@pytest.mark.parametrize("strategy", list(PLANS))
def test_a_nan_in_one_shard_is_seen_by_every_rank_and_flagged_where_it_is(ranks, strategy):
    for rank, got in enumerate(ranks):
        r = got[strategy]
        assert r["bad_norm"] != r["bad_norm"] and r["bad_loss"] == WORLD, r
        expected = [1, 0, 0, 0, 0, 0] if rank == WORLD - 1 else [0] * 6
        assert r["bad_flags"] == expected, (rank, r["bad_flags"])


@pytest.mark.parametrize("strategy", list(PLANS))
def test_uneven_ranks_give_the_mean_over_every_row_of_the_step(ranks, strategy):
    """A step whose ranks hold 2, 4, 6 and 8 rows (a language model's learned tokens differ
    from rank to rank): torch's norm and clip on one model whose loss is the mean over all
    20 rows, not the mean of the ranks' means."""
    ref = copy.deepcopy(_model())
    x, y = _data()
    inputs = torch.cat([x[r, :n] for r, n in enumerate(UNEVEN)])
    targets = torch.cat([y[r, :n] for r, n in enumerate(UNEVEN)])
    loss = torch.nn.functional.mse_loss(ref(inputs), targets)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    assert norm > MAX_NORM * 2
    for got in ranks:
        r = got[strategy]
        assert r["w_norm"] == pytest.approx(norm, rel=1e-5)
        assert r["w_loss"] == pytest.approx(float(loss), rel=1e-6)
        for a, p in zip(r["w_grads"], ref.parameters()):
            assert torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7)
