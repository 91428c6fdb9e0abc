"""Backend report: the NCCL transport parsed from real-shaped NCCL INFO lines (pure), and
the report a CPU run's workers write and `status` shows (real processes)."""
from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import SOCKET_FALLBACK_LOG, as_gpu_ranks_on_sockets, cli, small_config, write_config

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
    by_layer = br.layer_warnings(dict(gpu, bf16_supported=False, gpus_requested=4))
    assert [len(by_layer[k]) for k in ("kernels", "precision", "distributed")] == [0, 1, 1]
    assert br.layer_warnings({"device": "cpu", "gpus_requested": 4})["kernels"]
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


@pytest.mark.parametrize("device, sdpa, needle", [
    ("cpu", {"flash": True, "mem_efficient": False, "cudnn": False, "math": True}, None),
    ("cpu", {"flash": False, "mem_efficient": True, "cudnn": True, "math": True},
     "no fused attention kernel is enabled on cpu (flash off)"),
    ("cuda", {"flash": False, "mem_efficient": True, "cudnn": False, "math": True}, None),
    ("cuda", {"flash": False, "mem_efficient": False, "cudnn": False, "math": True},
     "no fused attention kernel is enabled on cuda (flash, mem_efficient, cudnn off)"),
    ("cuda", {"flash": False, "mem_efficient": False, "cudnn": False, "math": False},
     "every attention backend is off on cuda"),
])
def test_sdpa_backends_the_device_has_and_are_off_are_a_kernels_warning(device, sdpa, needle):
    """CPU attention has one fused kernel (flash, torch.backends.cuda's switch governs it
    too); CUDA has three. With none of them on, attention runs the math kernel."""
    got = br.layer_warnings({"device": device, "device_type": device, "sdpa": sdpa})
    assert got["precision"] == got["distributed"] == []
    assert (needle is None and got["kernels"] == []) or needle in got["kernels"][0], got


def test_the_cpu_flash_kernel_follows_the_cuda_flash_switch():
    """What FUSED_SDPA["cpu"] rests on, checked against this torch: with the flash switch
    off, CPU attention runs the math kernel."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import profile

    def kernels():
        q = torch.randn(2, 4, 16, 8)
        with profile() as prof:
            F.scaled_dot_product_attention(q, q, q)
        return {e.key for e in prof.key_averages() if "_scaled_dot_product" in e.key}

    assert kernels() == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert kernels() == {"aten::_scaled_dot_product_attention_math"}
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_nccl_debug_of_the_job_is_left_alone(tmp_path):
    env = br.nccl_log_env(tmp_path, 2, {})
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].endswith("nccl-rank-2.log")
    assert br.nccl_log_env(tmp_path, 2, {"NCCL_DEBUG": "WARN"}) == {}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("backends")
    cfg = small_config(tmp, "b", training={"max_steps": 2}, checkpoint={"every_steps": 2},
                       parallel={"nodes": 1, "procs_per_node": 2})
    done = cli("train", "--config", write_config(tmp / "b.yaml", **cfg))
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "runs" / "b"


def test_cpu_run_reports_gloo_lanes_and_status_shows_them(cpu_run):
    run = cpu_run
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


def test_status_warns_when_nccl_fell_back_to_sockets_on_an_efa_site(cpu_run, tmp_path):
    """The run's reports rewritten as its ranks write them on GPUs of a site whose profile
    is efa, with NCCL's init log saying it fell back to sockets (helpers.as_gpu_ranks_on_sockets):
    `status` shows the transport, the site's fabric and a warning per rank."""
    run = tmp_path / "gpu"
    shutil.copytree(cpu_run, run)
    as_gpu_ranks_on_sockets(run, "efa")
    status = cli("status", run)
    assert status.returncode == 0, status.stderr
    assert "backends:        cuda (2 rank(s)); lanes: accelerator cpu:gloo,cuda:nccl, " \
        "checkpoint gloo, control gloo; NCCL 2.23.4 over socket (site: efa)" in status.stdout
    for rank in (0, 1):
        assert f"warning: rank {rank}: the site expects efa but NCCL uses socket; see " \
            "docs/admin.md#nccl-profiles" in status.stdout, status.stdout
    same = tmp_path / "socket"  # the site asks for what NCCL uses: no warning
    shutil.copytree(cpu_run, same)
    as_gpu_ranks_on_sockets(same, "socket")
    assert "warning" not in cli("status", same).stdout


# docs/admin.md "First run on a new cluster": the words a placeholder stands for
CHECKLIST_PLACEHOLDERS = ("FABRIC", "A-B", "PCI", "IF", "R", "W", "L", "N", "C", "T", "S", "I",
                          "host", "addr")


def _checklist() -> dict[str, str]:
    """The checklist's log lines, by their first two words: the first column's code span."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "admin.md").read_text()
    section = text.split("## First run on a new cluster", 1)[1].split("\n## ", 1)[0]
    lines = [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", section, re.M)]
    return {" ".join(line.split()[:2]): line for line in lines}


def _matches(doc_line: str, logged: str) -> bool:
    """Placeholders match any word, `...` and `[...]` anything; the rest literally."""
    words = "|".join(re.escape(p) for p in CHECKLIST_PLACEHOLDERS)
    parts = re.split(rf"(\[\.\.\.\]|\.\.\.|(?<!\w)(?:{words})(?!\w))", doc_line)
    pattern = "".join(".*" if "..." in p else r"\S+" if p in CHECKLIST_PLACEHOLDERS
                      else re.escape(p) for p in parts)
    return re.fullmatch(pattern + r"(\s.*)?", logged) is not None


def test_the_first_run_checklist_shows_the_lines_workers_write(cpu_run):
    """Each line docs/admin.md tells an admin to look for is what the worker writes: the
    CPU run's own log for the lines every worker writes, the product's formatters for
    the GPU-only ones (placement with a GPU, the NCCL environment)."""
    from enn_cluster.config import nccl
    from enn_cluster.worker import entry, placement

    log = (sorted(cpu_run.glob("logs/*/rank-0.log"))[-1]).read_text().splitlines()
    logged = [line.split(" INFO ", 1)[1] for line in log if " INFO " in line]
    first = {" ".join(line.split()[:2]): line for line in reversed(logged)}
    profile_format = 'log.info("NCCL profile: %s", chosen)'  # rank 0, where NCCL runs
    assert profile_format in inspect.getsource(entry._configure_nccl)
    written = {
        "worker rank": first["worker rank"], "control plane:": first["control plane:"],
        "NCCL profile:": "NCCL profile: %s" % "ib",
        "NCCL environment": nccl.report({"NCCL_IB_TIMEOUT": "22"}, "ib")[0][1],
        "placement: rank": placement.describe(3, 3, range(36, 48), 12, "plan",
                                              "cuda:3 of [0,1,2,3,4,5,6,7] (0000:9c:00.0)", 0),
        # where the image lacks the host's HOME (tests/cluster/test_submit_identity.py runs it)
        "HOME is": "HOME is not a writable directory here: HOME and caches under %s"
                   % "/tmp/enn-cache-1000",
        # a site's TMPDIR the container lacks (tests/cluster/test_submit_identity.py runs it)
        "TMPDIR ...": "TMPDIR %s is not a writable directory here: temporary files go to %s"
                      % ("/local/job-9", "/tmp"),
        "ulimit -l:": nccl.memlock_problem("ib", 64 << 10)}
    assert '"TMPDIR %s is not a writable directory here: temporary files go to %s"' in \
        inspect.getsource(entry._setup_logging)
    assert '"HOME is not a writable directory here: HOME and caches under %s"' in \
        inspect.getsource(entry._setup_logging)
    doc = _checklist()
    assert sorted(doc) == sorted(written), doc  # a new row needs its check here
    for key, line in written.items():
        assert _matches(doc[key], line), (doc[key], line)
    assert not _matches(doc["placement: rank"], placement.describe(0, 0, [0, 1], 1, "none"))
    assert 'log.info("NCCL profile: %s", chosen)' in inspect.getsource(entry._configure_nccl)


def test_nccl_over_sockets_on_a_fabric_node_is_refused(tmp_path, cpu_run):
    """Issue 25 item 1: the report of a GPU rank whose NCCL fell back to sockets on an
    EFA (or IB) node is a refusal naming the fix; the worker stops with it (exit 2) unless
    the site allows the fallback. The same reports as status reads (as_gpu_ranks_on_sockets)."""
    from enn_cluster.storage.backend_report import newest_reports, transport_refusal
    from enn_cluster.storage.attempts import attempt_dirs
    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.worker import entry

    for site, refused in (("efa", True), ("ib", True), ("socket", False)):
        run = tmp_path / site
        shutil.copytree(cpu_run, run)
        as_gpu_ranks_on_sockets(run, site)
        _, reports = newest_reports(attempt_dirs(RunDir(run)))
        lines = [transport_refusal(r) for r in reports]
        if refused:
            assert all(line.startswith(f"NCCL: this {site} node runs NCCL over TCP sockets")
                       and "site.allow_socket_fallback: true" in line for line in lines), lines
        else:
            assert lines == [None, None]
    cpu = json.loads(sorted(cpu_run.glob("logs/*/backend-rank-0.json"))[-1].read_text())
    assert transport_refusal(cpu) is None  # a CPU rank has no NCCL transport to refuse
    source = inspect.getsource(entry._report_backends)
    assert "transport_refusal(report)" in source and "fallback_allowed(os.environ)" in source
