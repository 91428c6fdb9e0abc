"""Two ranks that claim one GPU on one host are refused on every rank, over the real
rendezvous store (2 processes) and before the accelerator lane exists: on a GPU node
NCCL's eager init would otherwise fail first with its own "Duplicate GPU detected", a
failure that is retried instead of our one line and exit 2. No GPU is needed: the claim is
the device name lanes.device_id would give, named in fault_injection.DEVICE_ID for a CPU run."""
from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta

import torch.multiprocessing as mp

from helpers import ROOT, cli, small_config, write_config

SHARED = "devices: ranks 0, 1 share {host}:GPU-aaa; "


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int):
    from enn_cluster.worker.environment import WorkerEnv

    return WorkerEnv("local", rank, rank, 2, 2, 0, 1, "127.0.0.1", port)


def _check(rank: int, port: int, claims: list, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from enn_cluster.errors import UserError
    from enn_cluster.worker.lanes import check_devices, rendezvous_store

    store = rendezvous_store(_env(rank, port), timedelta(seconds=60))
    results = []
    for round_, claim in enumerate(claims):
        try:
            check_devices(dist.PrefixStore(f"round-{round_}", store), rank, 2, claim[rank])
            results.append("ok")
        except UserError as exc:
            results.append(str(exc))
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(results, fh)
    store.set(f"done/{rank}", "1")  # answered: rank 1 has nothing more to ask the store
    if rank == 0:  # it hosts the store: it leaves once every rank is done with it
        store.wait([f"done/{r}" for r in range(2)])
    os._exit(0)  # as the worker does (worker.exit_now): no finalisation race


def test_shared_gpu_is_refused_on_every_rank(tmp_path):
    claims = [["GPU-aaa", "GPU-bbb"], ["GPU-aaa", "GPU-aaa"]]
    mp.spawn(_check, args=(_free_port(), claims, str(tmp_path / "out")), nprocs=2, join=True)
    for rank in (0, 1):
        ok, clash = json.loads((tmp_path / f"out.{rank}").read_text())
        assert ok == "ok"
        assert clash.startswith(SHARED.format(host=os.uname().nodename))
        assert "--gpus-per-task=1" in clash and "\n" not in clash


def _open(rank: int, port: int, claims: list, out: str) -> None:
    """The real open_lanes, with this rank's claim in fault_injection.DEVICE_ID: what it raised, and
    whether a default process group (the accelerator lane) existed afterwards."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from enn_cluster.errors import UserError
    from enn_cluster.worker.fault_injection import DEVICE_ID as FAULT_DEVICE_ID
    from enn_cluster.worker.lanes import close_lanes, open_lanes

    os.environ[FAULT_DEVICE_ID] = claims[rank]
    try:
        lanes = open_lanes(_env(rank, port), 60.0)
        error = None
        lanes.barrier()
    except UserError as exc:
        error = str(exc)
    result = {"error": error, "accelerator_lane": dist.is_initialized()}
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(result, fh)
    close_lanes()
    os._exit(0)


def test_refusal_comes_before_the_accelerator_lane(tmp_path):
    host = os.uname().nodename
    for claims, refused in ((["GPU-aaa", "GPU-bbb"], False), (["GPU-aaa", "GPU-aaa"], True)):
        out = tmp_path / f"open-{refused}"
        mp.spawn(_open, args=(_free_port(), claims, str(out)), nprocs=2, join=True)
        for rank in (0, 1):
            got = json.loads(out.with_name(f"{out.name}.{rank}").read_text())
            assert got["accelerator_lane"] is not refused  # never created when refused
            assert (got["error"] or "").startswith(SHARED.format(host=host) if refused else "")


def test_a_worker_on_a_shared_gpu_exits_2_and_is_not_retried(tmp_path):
    cfg = small_config(tmp_path, "shared", training={"max_steps": 2},
                       parallel={"nodes": 1, "procs_per_node": 2})
    done = cli("train", "--config", write_config(tmp_path / "shared.yaml", **cfg),
               env={"ENN_FAULT_DEVICE_ID": "GPU-aaa"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert SHARED.format(host=os.uname().nodename) in done.stderr
    logs = tmp_path / "runs" / "shared" / "logs"
    attempts = [d for d in logs.iterdir() if d.is_dir()]
    assert len(attempts) == 1, attempts  # exit 2 is never retried
    exits = [json.loads(p.read_text())["code"] for p in attempts[0].glob("exit-rank-*.json")]
    assert exits == [2, 2]
    assert not list(attempts[0].glob("backend-rank-*.json"))  # no lanes, no report
    for rank in (0, 1):  # each rank placed itself first, then was refused
        assert "placement: rank" in (attempts[0] / f"rank-{rank}.log").read_text()
