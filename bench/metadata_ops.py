"""Filesystem metadata operations per checkpoint per rank, counted with strace.

On Lustre every open, create, rename, stat, fsync and directory listing is a request to
the metadata server, which all ranks of all jobs share: what a checkpoint costs there is
a count, not a time. A group of W ranks (2 and 4; an MLP 6 x 256 wide with AdamW state)
runs the real `checkpoint.save` twice under `strace -f`; the second save is counted
between two marker stats each rank makes around it. Counted: calls naming a path under
the checkpoint root (open/create, rename, stat, mkdir, unlink) and every fsync/fdatasync
and getdents64 in that window (fd-based calls carry no path). The target: the count per
rank does not grow with the world size, and one process (rank 0) lists directories, as
often at world 4 as at world 2.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from .measure import BenchContext, Result, Series

SYSCALLS = ("openat", "open", "creat", "rename", "renameat", "renameat2", "stat", "lstat",
            "newfstatat", "statx", "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir",
            "fsync", "fdatasync", "getdents64")
CLASSES = {"openat": "open", "open": "open", "creat": "open", "rename": "rename",
           "renameat": "rename", "renameat2": "rename", "stat": "stat", "lstat": "stat",
           "newfstatat": "stat", "statx": "stat", "mkdir": "mkdir", "mkdirat": "mkdir",
           "unlink": "unlink", "unlinkat": "unlink", "rmdir": "unlink", "fsync": "fsync",
           "fdatasync": "fsync", "getdents64": "listdir"}
FD_ONLY = {"fsync", "fdatasync", "getdents64"}
MARK = ".enn-bench-mark"
_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(\w+)\((.*)$")


def count_window(trace: str, root: str) -> dict:
    """Per class, the calls between the first begin marker and the last end marker of a
    `strace -f -ttt` trace that name a path under `root` (fd-only calls: all). Also the
    listings of directories under `root` (openat with O_DIRECTORY). Pure."""
    lines = [m.groups() for m in map(_LINE.match, trace.splitlines()) if m]
    begins = [float(t) for _, t, _, args in lines if f"{MARK}-begin" in args]
    ends = [float(t) for _, t, _, args in lines if f"{MARK}-end" in args]
    if not begins or not ends:
        raise RuntimeError("strace trace holds no markers: the save was not traced")
    lo, hi = min(begins), max(ends)
    counts: Counter = Counter()
    listings, listers = 0, set()
    for pid, t, call, args in lines:
        if not lo < float(t) < hi or call not in SYSCALLS or MARK in args:
            continue
        if call in FD_ONLY or root in args:
            counts[CLASSES[call]] += 1
            if call == "openat" and "O_DIRECTORY" in args and root in args:
                listings += 1
                listers.add(pid)
    return {"counts": dict(counts), "dir_listings": listings, "listers": len(listers)}


def _worker(run_dir: str, root: str) -> None:
    import torch

    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.worker import checkpoint as ckpt
    from enn_cluster.worker.environment import discover
    from enn_cluster.worker.lanes import close_lanes, open_lanes
    from enn_cluster.worker.sampler import epoch_permutation
    from enn_cluster.worker.trainer import Trainer

    torch.set_num_threads(1)
    env = discover(os.environ)
    lanes = open_lanes(env, 600.0)
    run = RunDir(Path(run_dir))
    trainer = Trainer(run.load_config(), run, env, lanes)
    try:
        perm = epoch_permutation(trainer.n_rows, trainer.cfg.training.seed, 0)
        for _ in range(2):
            trainer.train_step(perm)

        def save(step: int) -> None:
            ckpt.save(Path(root), step, trainer.sm.model, trainer.optimizer,
                      trainer.state_dict(), lanes)

        save(1)  # warm: lazy imports and first-use paths are not the steady state
        lanes.barrier()
        os.path.exists(os.path.join(root, f"{MARK}-begin-{lanes.rank}"))
        save(2)
        os.path.exists(os.path.join(root, f"{MARK}-end-{lanes.rank}"))
        lanes.barrier()
    finally:
        trainer.close()
        close_lanes()


def group(run_dir: str, root: str, world: int) -> None:
    """Entry of the traced interpreter: `world` ranks run _worker."""
    from .group import run_group

    run_group(_worker, world, run_dir, root)


def _traced(ctx: BenchContext, world: int) -> dict:
    from enn_cluster.client.prepare import LaunchShape, prepare_run
    from enn_cluster.config.loading import config_from_dict

    cfg = config_from_dict({
        "run_name": f"meta-{world}", "runs_root": str(ctx.workdir / "runs"),
        "model": {"name": "mlp", "hidden_sizes": [256] * 6},
        "data": {"synthetic": {"n_samples": 1024, "n_features": 16}},
        "training": {"max_steps": 1000, "per_device_train_batch_size": 8, "seed": 0},
        "checkpoint": {"keep_last": 5}, "parallel": {"nodes": 1, "procs_per_node": world}})
    run = prepare_run(cfg, LaunchShape(1, world))
    root = ctx.workdir / f"meta-ckpt-{world}"
    root.mkdir()
    trace = ctx.workdir / f"strace-{world}.txt"
    code = "import sys; from bench.metadata_ops import group; group(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    res = subprocess.run(["strace", "-f", "-ttt", "-qq", "-e", f"trace={','.join(SYSCALLS)}",
                          "-o", str(trace), sys.executable, "-c", code, str(run.path), str(root),
                          str(world)], capture_output=True, text=True, timeout=900,
                         env=ctx.subprocess_env(), cwd=ctx.root)
    if res.returncode != 0:
        raise RuntimeError(f"traced save exited {res.returncode}: {res.stderr[-800:]}")
    try:
        return count_window(trace.read_text(errors="replace"), str(root))
    finally:
        trace.unlink()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run.path, ignore_errors=True)


def run(ctx: BenchContext) -> list[Result]:
    if shutil.which("strace") is None:
        return [Result("metadata", "metadata ops per checkpoint per rank",
                       skipped="strace not installed (apt-get install -y strace)")]
    per_world = {w: _traced(ctx, w) for w in (2, 4)}
    results = []
    for w, found in per_world.items():
        per_rank = {k: v / w for k, v in sorted(found["counts"].items())}
        total = sum(per_rank.values())
        results.append(Result(
            "metadata", f"metadata ops per checkpoint per rank, world {w}", samples=[total],
            unit="ops", ours=Series("checkpoint.save under strace", "ops/rank", [total]),
            note="per rank: " + ", ".join(f"{k} {v:g}" for k, v in per_rank.items()) +
                 f"; directory listings under the checkpoint root: {found['dir_listings']} "
                 f"by {found['listers']} process(es)"))
    small, large = (sum(per_world[w]["counts"].values()) / w for w in (2, 4))
    growth = large / small if small else float("inf")
    check = Result("metadata", "metadata ops per rank, world 4 / world 2", "<=", 1.2,
                   samples=[growth], note="a constant per rank: the ratio stays near 1")
    listed = [per_world[w]["dir_listings"] for w in (2, 4)]
    if per_world[4]["listers"] > 1 or listed[1] > listed[0]:
        check.check_failed = (f"{per_world[4]['listers']} processes list directories at world 4 "
                              f"({listed[0]} listings at world 2, {listed[1]} at world 4)")
    return results + [check]
