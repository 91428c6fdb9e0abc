"""Backend report: the NCCL transport parsed from real-shaped NCCL INFO lines (pure), and
the report a CPU run's workers write and `status` shows (real processes)."""
from __future__ import annotations

import json

import pytest
from helpers import cli, small_config, write_config

from enn_cluster.storage import backend_report as br
from enn_cluster.worker.placement import parse_cpulist

IB_LOG = [
    "node1:4242:4242 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
    "node1:4242:4301 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>",
    "node1:4242:4301 [0] NCCL INFO Using network IB",
    "node1:4242:4301 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA",
]
EFA_LOG = [
    "ip-10-1-2-3:77:77 [0] NCCL INFO NCCL version 2.23.4+cuda12.6",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)",
    "ip-10-1-2-3:77:90 [0] NCCL INFO Using network Libfabric",
]
SOCKET_FALLBACK_LOG = [  # EFA plugin absent: NCCL falls back to TCP
    "ip-10-1-2-3:77:77 [0] NCCL INFO NCCL version 2.23.4+cuda12.6",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/IB : No device found.",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/Socket : Using [0]ens32:10.1.2.3<0>",
    "ip-10-1-2-3:77:90 [0] NCCL INFO Using network Socket",
]
CHANNEL_ONLY_LOG = ["n1:1:2 [3] NCCL INFO Channel 01/0 : 3[3] -> 11[3] [send] via NET/AWS Libfabric/1"]


@pytest.mark.parametrize("lines, transport, version", [
    (IB_LOG, "ib", "2.21.5"), (EFA_LOG, "efa", "2.23.4"),
    (SOCKET_FALLBACK_LOG, "socket", "2.23.4"), (CHANNEL_ONLY_LOG, "efa", None),
    (["NCCL INFO Using network IBext_v8"], "ib", None), ([], None, None)])
def test_nccl_transport_and_version_from_log_lines(lines, transport, version):
    assert br.nccl_transport(lines) == transport
    assert br.nccl_version_from_log(lines) == version


def test_expected_fabric_and_mismatch_warnings():
    assert br.expected_fabric("efa", "socket") == "efa"  # the site's profile wins
    assert br.expected_fabric("auto", "ib") == "ib"
    assert br.expected_fabric("none", "ib") is None
    gpu = {"rank": 3, "device": "cuda:0", "expected_fabric": "efa",
           "nccl_transport": br.nccl_transport(SOCKET_FALLBACK_LOG), "bf16": True,
           "bf16_supported": True}
    (warning,) = br.mismatches(gpu)
    assert warning.startswith("the site expects efa but NCCL uses socket")
    assert br.mismatches(dict(gpu, nccl_transport="efa")) == []
    assert "transport is unknown" in br.mismatches(dict(gpu, nccl_transport=None))[0]
    assert "no bf16 support" in br.mismatches(dict(gpu, nccl_transport="efa",
                                                   bf16_supported=False))[0]
    assert "runs on the CPU" in br.mismatches({"device": "cpu", "gpus_requested": 4})[0]
    assert br.mismatches({"device": "cpu", "gpus_requested": 0}) == []
    lines = br.summarize([dict(gpu, nccl_version="2.23.4", lanes={"accelerator": "nccl"})])
    assert "NCCL 2.23.4 over socket (site: efa)" in lines[0]
    assert lines[1] == "warning: rank 3: " + warning


def test_placement_is_summarised_and_one_cpu_per_gpu_warned():
    def rank(r, cpus, by="plan"):
        return {"rank": r, "device": "cuda:0", "placement": {
            "cpus": "0-11", "cpu_count": cpus, "threads": cpus, "bound_by": by}}
    lines = br.summarize([rank(0, 12), rank(1, 12), rank(2, 1, "launcher")])
    assert lines[1] == ("placement: 1 rank(s) with 1 CPUs, 1 threads, bound by launcher; "
                        "2 rank(s) with 12 CPUs, 12 threads, bound by plan")
    assert lines[2:] == ["warning: rank 2: the rank has 1 CPU for its GPU (loader, NCCL "
                         "proxy, checkpoint thread share it): no CPUs per task reached srun; "
                         "see docs/admin.md#first-run-on-a-new-cluster"]
    assert br.mismatches(dict(rank(0, 1), device="cpu")) == []  # a CPU rank: one is fine


def test_nccl_debug_of_the_job_is_left_alone(tmp_path):
    env = br.nccl_log_env(tmp_path, 2, {})
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].endswith("nccl-rank-2.log")
    assert br.nccl_log_env(tmp_path, 2, {"NCCL_DEBUG": "WARN"}) == {}


def test_cpu_run_reports_gloo_lanes_and_status_shows_them(tmp_path):
    cfg = small_config(tmp_path, "b", training={"max_steps": 2}, checkpoint={"every_steps": 2},
                       parallel={"nodes": 1, "procs_per_node": 2})
    done = cli("train", "--config", write_config(tmp_path / "b.yaml", **cfg))
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "runs" / "b"
    files = sorted(run.glob("logs/*/backend-rank-*.json"))
    assert [f.name for f in files] == ["backend-rank-0.json", "backend-rank-1.json"]
    for rank, path in enumerate(files):
        rep = json.loads(path.read_text())
        assert rep["rank"] == rank and rep["device"] == "cpu"
        assert rep["lanes"] == {"accelerator": "gloo", "control": "gloo", "checkpoint": "gloo"}
        assert rep["bf16"] is False and rep["compile"] is False
        assert rep["nccl_version"] is None and rep["expected_fabric"] is None
        assert set(rep["sdpa"]) == {"flash", "mem_efficient", "cudnn", "math"}
        placed = rep["placement"]  # as the rank's placement line says
        assert placed["device"] is None and placed["numa"] is None
        assert placed["cpu_count"] == len(parse_cpulist(placed["cpus"])) >= 1
        assert placed["threads"] >= 1 and placed["bound_by"] in ("none", "launcher")
        log = (path.parent / f"rank-{rank}.log").read_text()
        assert (f"cpus {placed['cpus']} ({placed['cpu_count']}) threads {placed['threads']} "
                f"bound-by {placed['bound_by']}") in log
    status = cli("status", run)
    assert status.returncode == 0, status.stderr
    assert ("backends:        cpu (2 rank(s)); lanes: accelerator gloo, checkpoint gloo, "
            "control gloo; bf16 off; compile off; SDPA ") in status.stdout
    assert "                 placement: 2 rank(s) with " in status.stdout
    assert "warning" not in status.stdout
