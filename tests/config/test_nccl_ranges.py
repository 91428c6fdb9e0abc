"""Every NCCL/libfabric/torch/gloo value the code sets lies in its documented range.

The table below is written from the references, independently of the code:
- NCCL env vars: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  NCCL_IB_TIMEOUT: InfiniBand Verbs timeout, 4.096 us * 2^value; the verbs field
  (ibv_qp_attr.timeout) has 5 bits, so 1..31 (0 = infinite, never wanted).
  NCCL_IB_RETRY_CNT: InfiniBand retry count, default 7; the verbs field
  (ibv_qp_attr.retry_cnt) has 3 bits, so 0..7 (the IB spec, "Retry Count", 3 bits;
  rdma-core man ibv_modify_qp: "retry_cnt: Number of retries (3 bits)").
  NCCL_IB_DISABLE: 1 disables the IB/RoCE transport (0 or 1).
  NCCL_DEBUG: VERSION, WARN, INFO, TRACE. NCCL_DEBUG_SUBSYS: a comma list of subsystem
  names, '^' before one excludes it. NCCL_DEBUG_FILE: a file name, %h/%p expanded.
  NCCL_SOCKET_IFNAME: prefixes, '^' excludes, '=' matches a name exactly. NCCL_IB_HCA: the
  same syntax for HCA names. NCCL_NET_PLUGIN: "Plugin suffix, plugin file name, or none"
  (older NCCL: suffix only). NCCL_NET: "IB", "Socket", or the name a plugin registers.
- torch ProcessGroupNCCL env vars (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp and
  https://pytorch.org/docs/stable/torch_nccl_environment_variables.html):
  TORCH_NCCL_ASYNC_ERROR_HANDLING 0..3 (3 = SkipCleanUp... tear down), TORCH_NCCL_DUMP_ON_TIMEOUT
  boolean, TORCH_FR_BUFFER_SIZE a non-negative entry count (0 disables the recorder),
  TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC seconds (an int, default 480), TORCH_FR_DUMP_TEMP_FILE
  (formerly TORCH_NCCL_DEBUG_INFO_TEMP_FILE) the dump file's prefix, the rank appended.
- gloo: GLOO_SOCKET_IFNAME names interfaces, comma-separated, no NCCL filter syntax
  (https://pytorch.org/docs/stable/distributed.html#choosing-the-network-interface-to-use).
- libfabric EFA provider (man fi_efa): FI_EFA_USE_DEVICE_RDMA, FI_EFA_USE_HUGE_PAGE and
  FI_EFA_SET_CUDA_SYNC_MEMOPS are booleans; FI_PROVIDER names a provider (here efa).
- aws-ofi-nccl's network name: "AWS Libfabric" up to 1.11; later releases register
  "Libfabric" and answer to "AWS Libfabric" or "OFI" when NCCL_NET asks
  (https://github.com/aws/aws-ofi-nccl/pull/530).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from enn_cluster.config import nccl
from enn_cluster.storage import backend_report
from enn_cluster.worker import control_net, exec_env


@dataclass(frozen=True)
class FreeForm:
    """A name, path or list the code never judges at runtime; the test checks its shape."""

    reason: str
    shape: Callable[[str], bool]


def _names(value: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*", value) is not None


SUBSYSTEMS = {"INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL",
              "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL"}

DOCUMENTED: dict[str, object] = {
    "NCCL_IB_TIMEOUT": range(1, 32),
    "NCCL_IB_RETRY_CNT": range(0, 8),
    "NCCL_IB_DISABLE": range(0, 2),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": range(0, 4),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": range(0, 2),
    "TORCH_FR_BUFFER_SIZE": range(0, 2**31),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": range(1, 2**31),  # 0 s would kill at once
    "FI_EFA_USE_DEVICE_RDMA": range(0, 2),
    "FI_EFA_USE_HUGE_PAGE": range(0, 2),
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": range(0, 2),
    "FI_PROVIDER": {"efa"},
    "NCCL_DEBUG": {"VERSION", "WARN", "INFO", "TRACE"},
    "NCCL_DEBUG_SUBSYS": FreeForm(
        "a list of subsystem names: judged item by item here, not by the report",
        lambda v: all(item.lstrip("^") in SUBSYSTEMS for item in v.split(","))),
    "NCCL_DEBUG_FILE": FreeForm("a path of the job's choosing", os.path.isabs),
    "TORCH_FR_DUMP_TEMP_FILE": FreeForm("a path prefix of the job's choosing", os.path.isabs),
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": FreeForm("the same prefix, torch's old name",
                                                os.path.isabs),
    "NCCL_SOCKET_IFNAME": FreeForm(
        "interface names differ per node; we set only '=NAME' (exact match)",
        lambda v: v.startswith("=") and _names(v[1:])),
    "GLOO_SOCKET_IFNAME": FreeForm("interface names differ per node; plain names for gloo",
                                   _names),
    "NCCL_IB_HCA": FreeForm("HCA names differ per node; '=' for exact names",
                            lambda v: v.startswith("=") and _names(v[1:])),
    "NCCL_NET_PLUGIN": FreeForm(
        "plugins are named by their files; we set the suffix, the form every NCCL reads",
        lambda v: re.fullmatch(r"[A-Za-z0-9_-]+", v) is not None),
    "NCCL_NET": FreeForm(
        "plugins name their own networks (IBext, ...): the report must not flag a user's; "
        "we set only aws-ofi-nccl's name that holds across its releases",
        lambda v: v == "AWS Libfabric"),
    "LD_LIBRARY_PATH": FreeForm("library directories of the image (ld.so(8)): absolute paths",
                                lambda v: all(os.path.isabs(p) for p in v.split(":"))),
}


def _emitted() -> list[tuple[str, str, str]]:
    """(where, name, value) for every variable the code sets, from representative inputs."""
    interfaces = nccl.Interfaces(ib_devices=("mlx5_0", "mlx5_1"), ib_hca=("mlx5_0:1", "mlx5_1:1"))
    sources = [(f"nccl_env({p})", nccl.nccl_env(p, {}, interfaces)) for p in nccl.FABRICS]
    sources += [(f"script_env({p})", nccl.script_env(p)) for p in nccl.PROFILES]
    sources += [(f"heartbeat_env({t})", nccl.heartbeat_env(t)) for t in (0, 300, 86400)]
    sources.append(("flight_recorder_env", nccl.flight_recorder_env("/runs/r/logs/a", {})))
    sources.append(("nccl_log_env", backend_report.nccl_log_env(Path("/runs/r/logs/a"), 3, {})))
    for library in exec_env.PLUGIN_LIBRARIES:
        plugin = exec_env.Plugin("/opt/amazon/ofi-nccl/lib", library)
        sources.append((f"exec_env({library})", exec_env.exec_env(
            {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}, "efa", True, plugin,
            exec_env.LIBFABRIC_DIRS)))
    sources.append(("control_env(routed)", control_net.control_env({}, "ib0")))
    sources.append(("control_env(site)", control_net.control_env(
        {control_net.SITE_VAR: "bond0"}, None)))
    return [(where, name, value) for where, env in sources for name, value in env.items()]


EMITTED = _emitted()


def test_every_source_emits_something():
    wheres = {where for where, _, _ in EMITTED}
    assert {"nccl_log_env", "flight_recorder_env", "control_env(routed)",
            "exec_env(libnccl-net-ofi.so)", "heartbeat_env(300)"} <= wheres


@pytest.mark.parametrize("where,name,value", EMITTED)
def test_every_value_we_set_is_in_its_documented_range(where, name, value):
    assert name in DOCUMENTED, f"{name} (from {where}): add it to this table with a reference"
    allowed = DOCUMENTED[name]
    if isinstance(allowed, FreeForm):
        assert allowed.shape(value), f"{name}={value!r} from {where}: not {allowed.reason}"
    elif isinstance(allowed, set):
        assert value in allowed, f"{name}={value!r} from {where}"
    else:
        assert value.isdigit() and int(value) in allowed, f"{name}={value!r} from {where}"


def test_the_code_checks_the_same_ranges():
    for name, allowed in DOCUMENTED.items():
        if isinstance(allowed, FreeForm):
            assert name not in nccl.RANGES, f"{name}: {allowed.reason}"
        elif isinstance(allowed, set):
            assert nccl.RANGES[name] == allowed
        else:
            assert nccl.RANGES[name] == (allowed.start, allowed.stop - 1)
    assert set(nccl.RANGES) <= set(DOCUMENTED)


@pytest.mark.parametrize("values,bad", [
    ({"NCCL_IB_RETRY_CNT": "14"}, ["NCCL_IB_RETRY_CNT=14 (expected 0..7)"]),
    ({"NCCL_IB_TIMEOUT": "0"}, ["NCCL_IB_TIMEOUT=0 (expected 1..31)"]),
    ({"NCCL_IB_TIMEOUT": "x"}, ["NCCL_IB_TIMEOUT=x (expected 1..31)"]),
    ({"FI_PROVIDER": "tcp"}, ["FI_PROVIDER=tcp (expected efa)"]),
    ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "0"},
     ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=0 (expected 1..2147483647)"]),
    ({"NCCL_DEBUG": "LOUD"}, ["NCCL_DEBUG=LOUD (expected INFO or TRACE or VERSION or WARN)"]),
    ({"NCCL_DEBUG": "info"}, []),  # NCCL reads the word case-insensitively
    ({"NCCL_IB_RETRY_CNT": "7", "NCCL_NET": "IBext"}, []),  # free-form: not judged
])
def test_out_of_range_values_are_named(values, bad):
    assert nccl.out_of_range(values) == bad
