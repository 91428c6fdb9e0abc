"""Every NCCL/libfabric/torch value a profile sets lies in its documented range.

The table below is written from the references, independently of enn_cluster/nccl.py:
- NCCL env vars: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  NCCL_IB_TIMEOUT: InfiniBand Verbs timeout, 4.096 us * 2^value; the verbs field
  (ibv_qp_attr.timeout) has 5 bits, so 1..31 (0 = infinite, never wanted).
  NCCL_IB_RETRY_CNT: InfiniBand retry count, default 7; the verbs field
  (ibv_qp_attr.retry_cnt) has 3 bits, so 0..7 (the IB spec, "Retry Count", 3 bits;
  rdma-core man ibv_modify_qp: "retry_cnt: Number of retries (3 bits)").
  NCCL_IB_DISABLE: 1 disables the IB/RoCE transport (0 or 1).
- torch ProcessGroupNCCL env vars (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp):
  TORCH_NCCL_ASYNC_ERROR_HANDLING 0..3 (3 = SkipCleanUp... tear down), TORCH_NCCL_DUMP_ON_TIMEOUT
  boolean, TORCH_FR_BUFFER_SIZE a non-negative entry count (0 disables the recorder).
- libfabric EFA provider (man fi_efa): FI_EFA_USE_DEVICE_RDMA, FI_EFA_USE_HUGE_PAGE and
  FI_EFA_SET_CUDA_SYNC_MEMOPS are booleans; FI_PROVIDER names a provider (here efa).
"""
from __future__ import annotations

import pytest

from enn_cluster.config import nccl

DOCUMENTED = {
    "NCCL_IB_TIMEOUT": range(1, 32),
    "NCCL_IB_RETRY_CNT": range(0, 8),
    "NCCL_IB_DISABLE": range(0, 2),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": range(0, 4),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": range(0, 2),
    "TORCH_FR_BUFFER_SIZE": range(0, 2**31),
    "FI_EFA_USE_DEVICE_RDMA": range(0, 2),
    "FI_EFA_USE_HUGE_PAGE": range(0, 2),
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": range(0, 2),
    "FI_PROVIDER": {"efa"},
}


def _emitted() -> dict[str, str]:
    out: dict[str, str] = {}
    for profile in ("efa", "ib", "socket"):
        out.update(nccl.nccl_env(profile, {}, nccl.Interfaces(ib_devices=("mlx5_0",))))
    return out


@pytest.mark.parametrize("name,value", sorted(_emitted().items()))
def test_every_value_we_set_is_in_its_documented_range(name, value):
    if name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        assert value.startswith(("^", "=")), value  # interface/device lists, not numbers
        return
    assert name in DOCUMENTED, f"{name}: add its documented range to this table"
    allowed = DOCUMENTED[name]
    assert (value in allowed) if isinstance(allowed, set) else (int(value) in allowed)


def test_the_code_checks_the_same_ranges():
    for name, allowed in DOCUMENTED.items():
        if isinstance(allowed, set):
            assert nccl.RANGES[name] == allowed
        else:
            assert nccl.RANGES[name] == (allowed.start, allowed.stop - 1)


@pytest.mark.parametrize("values,bad", [
    ({"NCCL_IB_RETRY_CNT": "14"}, ["NCCL_IB_RETRY_CNT=14 (expected 0..7)"]),
    ({"NCCL_IB_TIMEOUT": "0"}, ["NCCL_IB_TIMEOUT=0 (expected 1..31)"]),
    ({"NCCL_IB_TIMEOUT": "x"}, ["NCCL_IB_TIMEOUT=x (expected 1..31)"]),
    ({"FI_PROVIDER": "tcp"}, ["FI_PROVIDER=tcp (expected efa)"]),
    ({"NCCL_IB_RETRY_CNT": "7", "NCCL_DEBUG": "INFO"}, []),  # no range known: not judged
])
def test_out_of_range_values_are_named(values, bad):
    assert nccl.out_of_range(values) == bad
