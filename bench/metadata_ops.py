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

A signal from outside (a SIGTERM once killed this benchmark in a busy run: strace passes
a fatal signal it receives on to the program it started, the elastic agent, which then
raises SignalException; nothing in the benchmark or in torchelastic sends SIGTERM to the
agent) is named from the trace, sender pid and command, and the traced save runs once
more. With `--seccomp-bpf` only the counted calls stop the tracees, which cuts the time
a busy machine has to interfere with.
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
_SIGNAL = re.compile(r"^(\d+)\s+[\d.]+\s+--- (SIG\w+) \{si_signo=\w+, si_code=SI_(?:USER|QUEUE|TKILL)"
                     r", si_pid=(\d+)")
TRIES = 2


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


def signals_sent(trace: str, tracer_pid: int) -> list[str]:
    """Fatal signals sent to traced processes by a process (not the kernel), one line each:
    receiver, signal, sender (strace itself: strace was signalled from outside). Pure."""
    found = []
    for line in trace.splitlines():
        m = _SIGNAL.match(line)
        if m and m.group(2) in ("SIGTERM", "SIGINT", "SIGHUP", "SIGKILL", "SIGQUIT"):
            sender = int(m.group(3))
            who = "strace, signalled from outside" if sender == tracer_pid else \
                _command_of(sender)
            found.append(f"pid {m.group(1)} got {m.group(2)} from pid {sender} ({who})")
    return found


def _command_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"


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
    notes = []
    try:
        for attempt in range(1, TRIES + 1):
            found, why = _trace_once(ctx, run.path, root, world)
            if found is not None:
                return {**found, "retried": notes}
            notes.append(f"attempt {attempt}: {why}")
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
        raise RuntimeError("traced save failed: " + "; ".join(notes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run.path, ignore_errors=True)


def _trace_once(ctx: BenchContext, run_path: Path, root: Path, world: int):
    """(counts, None) or (None, why it failed, with any signal's sender)."""
    trace = ctx.workdir / f"strace-{world}.txt"
    code = "import sys; from bench.metadata_ops import group; group(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    proc = subprocess.Popen(["strace", "-f", *_seccomp_flag(), "-ttt", "-qq", "-e",
                             f"trace={','.join(SYSCALLS)}", "-o", str(trace), sys.executable,
                             "-c", code, str(run_path), str(root), str(world)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ctx.subprocess_env(), cwd=ctx.root)
    try:
        _, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        err = "timed out after 900 s; " + err
    try:
        text = trace.read_text(errors="replace") if trace.exists() else ""
        if proc.returncode == 0:
            return count_window(text, str(root)), None
        senders = signals_sent(text, proc.pid)
        return None, (f"exited {proc.returncode}" + (f", {'; '.join(senders)}" if senders else "")
                      + f": {err.strip()[-600:]}")
    finally:
        trace.unlink(missing_ok=True)


def _seccomp_flag() -> tuple[str, ...]:
    """strace >= 5.3 stops the tracees only for the traced calls."""
    if shutil.which("strace") is None:
        return ()
    res = subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=openat", "-o",
                          os.devnull, "true"], capture_output=True)
    return ("--seccomp-bpf",) if res.returncode == 0 else ()



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
                 f"by {found['listers']} process(es)" +
                 (f"; retried after {', '.join(found['retried'])}" if found["retried"] else "")))
    small, large = (sum(per_world[w]["counts"].values()) / w for w in (2, 4))
    growth = large / small if small else float("inf")
    check = Result("metadata", "metadata ops per rank, world 4 / world 2", "<=", 1.2,
                   samples=[growth], note="a constant per rank: the ratio stays near 1")
    listed = [per_world[w]["dir_listings"] for w in (2, 4)]
    if per_world[4]["listers"] > 1 or listed[1] > listed[0]:
        check.check_failed = (f"{per_world[4]['listers']} processes list directories at world 4 "
                              f"({listed[0]} listings at world 2, {listed[1]} at world 4)")
    return results + [check]
