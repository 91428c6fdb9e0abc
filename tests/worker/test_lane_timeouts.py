"""Separate timeouts: the accelerator lane's collectives (parallel.timeout_s), the
rendezvous (parallel.rendezvous_timeout_s) and the checkpoint barriers on the control and
checkpoint lanes (checkpoint.barrier_timeout_s). Read back from a real 1-rank gloo group."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from enn_cluster.config.loading import config_from_dict
from enn_cluster.worker.environment import WorkerEnv
from enn_cluster.errors import UserError
from enn_cluster.worker.lanes import close_lanes, open_lanes


def _env() -> WorkerEnv:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return WorkerEnv("local", 0, 0, 1, 1, 0, 1, "127.0.0.1", port)


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.parametrize("rendezvous,barrier,expected_barrier", [(77.0, 55.0, 55.0),
                                                                 (77.0, 0.0, 30.0)])
def test_each_lane_gets_its_own_timeout(rendezvous, barrier, expected_barrier):
    lanes = open_lanes(_env(), 30.0, rendezvous, barrier)
    try:
        assert _timeout(dist.group.WORLD) == timedelta(seconds=30)
        assert dist.distributed_c10d._get_default_store().timeout == timedelta(seconds=rendezvous)
        assert _timeout(lanes.control) == timedelta(seconds=expected_barrier)
        assert _timeout(lanes.checkpoint) == timedelta(seconds=expected_barrier)
    finally:
        close_lanes()


@pytest.mark.parametrize("section,key,value", [
    ("parallel", "rendezvous_timeout_s", 0), ("checkpoint", "barrier_timeout_s", -1),
    ("parallel", "reduce_dtype", "fp16")])
def test_bad_values_name_the_key(section, key, value):
    with pytest.raises(UserError, match=rf"{section}\.{key}: "):
        config_from_dict({"run_name": "r", section: {key: value}})
