"""Two ranks that claim one GPU on one host are refused on every rank, over a real gloo
control lane (2 processes); distinct GPUs pass. No GPU is needed: the claim is the device
name lanes.device_id would give."""
from __future__ import annotations

import json
import os
import sys

import torch.multiprocessing as mp

from helpers import ROOT


def _rank(rank: int, init: str, claims: list, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from enn_cluster.errors import UserError
    from enn_cluster.worker.lanes import Lanes, check_devices

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    lanes = Lanes(control=dist.group.WORLD, checkpoint=None, device=torch.device("cpu"),
                  rank=rank, world_size=2)
    results = []
    for claim in claims:
        try:
            check_devices(lanes, claim[rank])
            results.append("ok")
        except UserError as exc:
            results.append(str(exc))
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(results, fh)
    os._exit(0)  # as the worker does (worker.exit_now): no finalisation race with gloo threads


def test_shared_gpu_is_refused_on_every_rank(tmp_path):
    claims = [["GPU-aaa", "GPU-bbb"], ["GPU-aaa", "GPU-aaa"]]
    init = f"file://{tmp_path / 'rdzv'}"
    mp.spawn(_rank, args=(init, claims, str(tmp_path / "out")), nprocs=2, join=True)
    for rank in (0, 1):
        ok, clash = json.loads((tmp_path / f"out.{rank}").read_text())
        assert ok == "ok"
        assert clash.startswith(f"devices: ranks 0, 1 share {os.uname().nodename}:GPU-aaa; ")
        assert "--gpus-per-task=1" in clash and "\n" not in clash
