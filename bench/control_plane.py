"""The checkpoint control plane at 64 -> 1,024 simulated ranks (no tensors, no network).

Each world size W runs in a fresh interpreter on torch's fake process group (one process
plays every rank in turn): a model of 200 parameters (8192 x 1024 matrices and 8192
vectors, as in a ~1B transformer) plus AdamW's two moments, FSDP-sharded over W ranks as
meta-device DTensors. Every rank's local save plan is made by DCP's DefaultSavePlanner;
then, timed on the coordinator:

- stock: `create_global_plan` over the W plans (once: ours saves with the same
  DefaultSavePlanner), the writer's `prepare_global_plan`, and `finish` (the `.metadata`
  pickled, fsynced and renamed into a real directory);
- ours: the same with our ChecksummingWriter, plus what `checkpoint._commit` adds on rank
  0: merge the W ranks' checksum records, one listing of the step directory (2W real empty
  files: a shard and an RNG file per rank), the `.metadata` checksum, and `commit.json`
  written and fsynced (writers and commit alternate 3 times: medians);
- resume, rank 0: the committed check of that step (its record read, every file stat'ed);
  every rank: the record read and parsed.

Reported per rank: the local plan's pickled bytes (sent to the coordinator), and what each
rank reads at resume (commit.json and `.metadata`). Targets: ours / stock <= 1.2 at 1,024
ranks, and our own work (commit record, committed check) growing no faster than linearly
(time(1024) / time(64) <= 16 x 1.25); DCP's own growth is reported beside it.
`simulate(W, DIR)` is the per-size entry, run in a fresh interpreter.
"""
from __future__ import annotations

import gc
import json
import math
import pickle
import subprocess
import time
from pathlib import Path

from .measure import BenchContext, Result, Series

TENSORS = 200


def _state(mesh, world: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    def shard(shape):
        local = (shape[0] // world, *shape[1:])
        return DTensor.from_local(torch.empty(local, device="meta"), mesh, [Shard(0)],
                                  run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    shapes = {f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}":
              ((8192, 1024) if i % 2 == 0 else (8192,)) for i in range(TENSORS)}
    return {"model": {k: shard(s) for k, s in shapes.items()},
            "optim": {"state": {k: {"exp_avg": shard(s), "exp_avg_sq": shard(s),
                                    "step": torch.tensor(10.0)} for k, s in shapes.items()},
                      "param_groups": [{"lr": 1e-3, "params": list(shapes)}]}}


def _local_plans(world: int) -> list:
    """Every rank's local save plan, as DCP makes it on that rank: untimed, but the bulk of
    this benchmark. The cyclic collector stays off meanwhile: it would rescan the plans
    made so far every few thousand new objects (twice the time; 0.8 GB at 512 ranks)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plans = []
    gc.disable()
    try:
        for rank in range(world):
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            planner = DefaultSavePlanner()
            planner.set_up_planner(_state(init_device_mesh("cpu", (world,)), world), None,
                                   rank == 0)
            plans.append(planner.create_local_plan())
            dist.destroy_process_group()
    finally:
        gc.enable()
        gc.collect()  # into the oldest generation, where the timed parts found them before
    return plans


def _write_results(plans: list) -> list:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out = []
    for i, plan in enumerate(plans):
        results, offset = [], 0
        for item in plan.items:
            results.append(WriteResult(index=item.index, size_in_bytes=4096,
                                       storage_data=_StorageInfo(f"__{i}_0.distcp", offset, 4096)))
            offset += 4096
        out.append(results)
    return out


def _finish(writer_cls, global_plans: list, metadata, path: Path) -> float:
    """The writer's coordinator part: storage prefixes, then `.metadata` written."""
    import copy

    metadata = copy.copy(metadata)
    gc.collect()  # a collection landing inside one side's pickling doubled it at random
    gc.disable()
    try:
        began = time.perf_counter()
        writer = writer_cls(path)
        writer.set_up_storage_writer(True)
        prepared = writer.prepare_global_plan(global_plans)
        writer.finish(metadata, _write_results(prepared))
        return time.perf_counter() - began
    finally:
        gc.enable()


def _commit(files_dir: Path, world: int, gathered: list) -> float:
    """What checkpoint._commit does on rank 0 (the product's own function)."""
    from enn_cluster.storage import commits as store

    began = time.perf_counter()
    store.commit_gathered(files_dir, 10, gathered, world_size=world,
                          contents=["model", "optim"], time=time.time(), save_seconds=0.0)
    return time.perf_counter() - began


def simulate(world: int, root: Path, repeats: int = 3) -> dict:
    """Entry of one world size's interpreter: the figures as a dict. The global plan is
    DCP's DefaultSavePlanner on both sides (ours saves with it), made once; the writers'
    parts and our commit alternate `repeats` times (medians)."""
    import statistics

    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from enn_cluster.storage import commits as store
    from enn_cluster.storage.checksum import file_checksum
    from enn_cluster.storage.dcp_io import ChecksummingWriter

    plans = _local_plans(world)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    began = time.perf_counter()
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)
    global_plans, metadata = planner.create_global_plan(plans)
    plan_s = time.perf_counter() - began
    ours_dir = store.step_dir(root / "ours", 10)
    (ours_dir / "rng").mkdir(parents=True)
    for rank in range(world):  # the files the ranks wrote, empty: only their names count
        (ours_dir / f"__{rank}_0.distcp").touch()
        (ours_dir / "rng" / f"rank-{rank}.pt").touch()
    empty = {"size": 0, "checksum": file_checksum(ours_dir / "rng" / "rank-0.pt")[1]}
    gathered = [{f"__{r}_0.distcp": empty, f"rng/rank-{r}.pt": empty} for r in range(world)]
    stock, ours, commit = [], [], []
    for i in range(repeats):
        stock_dir = root / f"stock-{i}"
        stock_dir.mkdir()
        for side in (("stock", "ours") if i % 2 == 0 else ("ours", "stock")):
            if side == "stock":
                stock.append(_finish(FileSystemWriter, global_plans, metadata, stock_dir))
            else:
                ours.append(_finish(ChecksummingWriter, global_plans, metadata, ours_dir))
                commit.append(_commit(ours_dir, world, gathered))
    began = time.perf_counter()
    committed = store.committed_steps(root / "ours")
    check_s = time.perf_counter() - began
    began = time.perf_counter()
    store.read_commit(ours_dir)
    read_s = time.perf_counter() - began
    dist.destroy_process_group()
    if committed != [10]:
        raise RuntimeError(f"the simulated step did not commit: {committed}")
    med = statistics.median
    return {"world": world, "plan_s": plan_s, "stock_parts": stock, "ours_parts": ours, "stock_s": plan_s + med(stock),
            "ours_s": plan_s + med(ours) + med(commit), "commit_s": med(commit),
            "resume_check_s": check_s, "record_read_s": read_s,
            "plan_bytes": len(pickle.dumps(plans[-1])),
            "commit_bytes": (ours_dir / store.COMMIT).stat().st_size,
            "metadata_bytes": (ours_dir / store.METADATA).stat().st_size}


def _one(ctx: BenchContext, world: int) -> dict:
    root = ctx.workdir / f"control-{world}"
    code = "import sys, json; from pathlib import Path; from bench.control_plane import simulate; " \
           "print(json.dumps(simulate(int(sys.argv[1]), Path(sys.argv[2]))))"
    res = subprocess.run([ctx.python, "-c", code, str(world), str(root)], capture_output=True,
                         text=True, env=ctx.subprocess_env(), cwd=ctx.root, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"control plane at {world} ranks exited {res.returncode}: "
                           f"{res.stderr[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(ctx: BenchContext) -> list[Result]:
    worlds = (64, 128, 256) if ctx.quick else (64, 128, 256, 512, 1024)
    ctx.log(f"control plane: {', '.join(map(str, worlds))} simulated ranks (fake process group)")
    found = [_one(ctx, w) for w in worlds]
    results = []
    for f in found:
        results.append(Result(
            "control", f"checkpoint control plane at {f['world']} ranks: ours / stock dcp.save "
                       "coordinator", "<=" if f is found[-1] else None,
            1.2 if f is found[-1] else None, samples=[f["ours_s"] / f["stock_s"]],
            ours=Series("global plan + .metadata + commit record", "s", [f["ours_s"]]),
            baseline=Series("stock global plan + .metadata", "s", [f["stock_s"]]),
            note=(f"DCP's global plan {f['plan_s']:.2f} s (both sides); commit record "
                  f"{f['commit_s'] * 1e3:.0f} ms; resume: rank 0's committed "
                  f"check {f['resume_check_s'] * 1e3:.0f} ms, each rank's record read "
                  f"{f['record_read_s'] * 1e3:.1f} ms; bytes per rank: local plan "
                  f"{f['plan_bytes']:,} sent, commit.json {f['commit_bytes']:,} and "
                  f".metadata {f['metadata_bytes']:,} read at resume")))
    first, last = found[0], found[-1]
    ranks = last["world"] / first["world"]

    def own(f):  # what ours adds: the commit record, and rank 0's committed check at resume
        return f["commit_s"] + f["resume_check_s"]

    results.append(Result(
        "control", f"growth of our own control-plane work {first['world']} -> {last['world']} "
                   "ranks, per rank added (1 = linear)", "<=", 1.25,
        samples=[own(last) / own(first) / ranks],
        note=(f"commit record + committed check {own(first) * 1e3:.0f} ms -> "
              f"{own(last) * 1e3:.0f} ms for {ranks:.0f}x the ranks; DCP's own coordinator "
              f"(the same on both sides) {first['stock_s']:.2f} s -> {last['stock_s']:.2f} s, "
              f"exponent {math.log(last['stock_s'] / first['stock_s']) / math.log(ranks):.2f}")))
    return results
