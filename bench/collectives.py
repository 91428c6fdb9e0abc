"""Count the collectives of one training step, ours next to the bare loop's (a profile for
the overhead benchmark, not a figure): `python -m bench.collectives [--steps N]`.

Both sides run the overhead benchmark's 4 CPU processes on a 2x2 HSDP mesh with
torch.distributed's collectives wrapped (process-group calls and the functional
all-reduce that DTensor's full_tensor uses) and print, per rank 0 step, which collectives
ran on which group. What only ours has is the difference.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

COUNTER = r"""
import collections, json, os, sys
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

calls = []
def label(group):
    if group is None or group is dist.group.WORLD:
        return "default"
    return f"{dist.get_backend(group)}[{dist.get_world_size(group)}]#{id(group) % 9973}"
def wrap(mod, name):
    original = getattr(mod, name)
    def counted(*a, **k):
        group = k.get("group", k.get("pg"))
        calls.append(f"{name} {label(group) if not isinstance(group, (str, list, tuple)) else group}")
        return original(*a, **k)
    setattr(mod, name, counted)
for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
             "barrier", "all_gather_object", "broadcast_object_list", "all_gather"):
    wrap(dist, name)
wrap(funcol, "all_reduce")
"""

OURS = COUNTER + r"""
from enn_cluster.worker import trainer as tr
from enn_cluster.worker.entry import run_task
starts = []
step = tr.Trainer.train_step
def train_step(self, *a, **k):
    starts.append(len(calls))
    return step(self, *a, **k)
tr.Trainer.train_step = train_step
code = run_task(sys.argv[1])
if os.environ["RANK"] == "0":
    per = [calls[a:b] for a, b in zip(starts, starts[1:])]
    print("COUNTS " + json.dumps(per[len(per) // 2]), flush=True)
os._exit(code)
"""

BARE = COUNTER + r"""
import numpy as np
from bench import bare_loop
x, y, model, opt = bare_loop.setup(*json.loads(sys.argv[1]))
rows = np.arange(64)
for _ in range(3):
    before = len(calls)
    bare_loop.step(model, opt, x, y, rows)
if os.environ["RANK"] == "0":
    print("COUNTS " + json.dumps(calls[before:]), flush=True)
dist.barrier()
os._exit(0)
"""


def _torchrun(script: str, *args: str, cwd: Path) -> list[str]:
    path = cwd / f"probe-{abs(hash(script)) % 10**6}.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", str(path), *args], capture_output=True,
                         text=True, timeout=600, cwd=cwd, env=env)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("COUNTS ")]
    if res.returncode != 0 or not line:
        raise RuntimeError(f"probe exited {res.returncode}: {res.stderr[-1500:]}")
    return json.loads(line[-1][len("COUNTS "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    from .measure import regression_arrays

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        x, y = regression_arrays(work, 4096, 64, 0)
        cfg = {"run_name": "count", "runs_root": str(work / "runs"),
               "model": {"name": "mlp", "hidden_sizes": [256] * 2},
               "data": {"train_path": str(x), "train_targets_path": str(y), "eval_fraction": 0.0},
               "training": {"max_steps": args.steps, "per_device_train_batch_size": 16,
                            "weight_decay": 0.0, "grad_clip": 1.0},
               "checkpoint": {"every_steps": 0}, "logging": {"every_steps": 1},
               "parallel": {"strategy": "hsdp", "nodes": 2, "procs_per_node": 2}}
        (work / "run.yaml").write_text(yaml.safe_dump(cfg))
        subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "prepare", "--config",
                        str(work / "run.yaml")], check=True, capture_output=True, cwd=work)
        ours = _torchrun(OURS, str(work / "runs" / "count"), cwd=work)
        bare_args = [str(x), str(y), [256] * 2, 2, 2, 1e-3, 0]
        bare = _torchrun(BARE, json.dumps(bare_args), cwd=work)
    for name, calls in (("ours (a middle step)", ours), ("bare loop (one step)", bare)):
        print(f"{name}: {len(calls)} collectives")
        for call, n in sorted(collections.Counter(calls).items()):
            print(f"  {n:3d} x {call}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
