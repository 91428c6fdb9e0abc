"""What actually runs on each rank: device, lane backends, NCCL version and transport,
SDPA backends, bf16, compile, the fabric the site expected, and the rank's placement
(its CPUs, threads and GPU, worker/placement.Placement.report).

Why: a job that silently runs NCCL over TCP on an EFA cluster, or fp32 where bf16 was
meant, is only slow; nothing fails. Each rank writes `backend-rank-R.json` into its
attempt's log directory; `status` and `doctor` read them back and turn a mismatch into
a warning. The parsing and comparison functions are pure (tests feed NCCL log lines);
`gather` reads torch and `write_report` writes the file.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Optional

from enn_cluster.errors import UserError
from enn_cluster.storage.run_files import read_run_text

REPORT_GLOB = "backend-rank-*.json"
NCCL_LOG_NAME = "nccl-rank-{rank}.log"  # NCCL_DEBUG_FILE when the job set no NCCL_DEBUG

# NCCL_DEBUG=INFO lines, in the order they decide: the network NCCL chose at init
# ("Using network IB"), else the transport a channel connected over ("via NET/Socket/0").
_NETWORK = re.compile(r"Using network (\S+(?: \S+)?)")
_CHANNEL = re.compile(r"via NET/([^/]+)/")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")


def _fabric_of(name: str) -> Optional[str]:
    low = name.lower()
    if "libfabric" in low or "ofi" in low or "efa" in low:
        return "efa"
    if low.startswith("ib"):  # IB, IBext, IBext_v8 (the SHARP plugin)
        return "ib"
    if low.startswith("socket"):
        return "socket"
    return None


def nccl_transport(lines: Iterable[str]) -> Optional[str]:
    """'efa' | 'ib' | 'socket' from NCCL's INFO log, or None when it says nothing."""
    network = channel = None
    for line in lines:
        found = _NETWORK.search(line)
        if found and network is None:
            network = _fabric_of(found.group(1))
        found = _CHANNEL.search(line)
        if found and channel is None:
            channel = _fabric_of(found.group(1))
    return network or channel


def nccl_version_from_log(lines: Iterable[str]) -> Optional[str]:
    for line in lines:
        found = _VERSION.search(line)
        if found:
            return found.group(1)
    return None


def expected_fabric(profile: Optional[str], detected: Optional[str]) -> Optional[str]:
    """The fabric the site asked for: an explicit profile, else what `auto` detected."""
    if profile in ("efa", "ib", "socket"):
        return profile
    if profile in (None, "", "auto"):
        return detected
    return None  # profile none: the site leaves NCCL alone


# The fused attention kernels each device type has (torch.backends.cuda's flags govern
# both: the CPU has a flash kernel of its own). With none enabled, scaled_dot_product_attention
# runs the math reference kernel: slower, and it materialises the attention matrix.
FUSED_SDPA = {"cpu": ("flash",), "cuda": ("flash", "mem_efficient", "cudnn")}


def _sdpa_warning(report: Mapping) -> Optional[str]:
    sdpa, fused = report.get("sdpa") or {}, FUSED_SDPA.get(report.get("device_type", ""))
    if not sdpa or not fused or any(sdpa.get(k) for k in fused):
        return None
    off = ", ".join(fused)
    if not sdpa.get("math"):
        return (f"SDPA: every attention backend is off on {report['device_type']} ({off} and "
                "math): scaled_dot_product_attention will fail")
    return (f"SDPA: no fused attention kernel is enabled on {report['device_type']} ({off} "
            "off): attention runs the math reference kernel (slower, more memory); something "
            f"in the job turned them off (torch.backends.cuda.enable_{fused[0]}_sdp(False) "
            "or the like)")


def transport_refusal(report: Mapping) -> Optional[str]:
    """The line a GPU rank stops with when NCCL fell back to TCP sockets on an EFA or IB
    node (an 8B all-reduce then takes seconds a step); None otherwise. The worker applies
    it unless the site allows the fallback (ENN_ALLOW_SOCKET_FALLBACK)."""
    expected, transport = report.get("expected_fabric"), report.get("nccl_transport")
    if not str(report.get("device", "cpu")).startswith("cuda") or transport != "socket" \
            or expected not in ("efa", "ib"):
        return None
    return (f"NCCL: this {expected} node runs NCCL over TCP sockets (the net plugin or the "
            f"verbs devices did not load; see nccl-rank-{report.get('rank')}.log); fix the "
            "image (docs/admin.md#nccl-profiles) or set site.allow_socket_fallback: true")


def layer_warnings(report: Mapping) -> dict[str, list[str]]:
    """One rank's report against what the site and config meant, by doctor layer:
    kernels (device, SDPA), precision (bf16), distributed (NCCL's transport)."""
    found = {"kernels": [], "precision": [], "distributed": []}
    expected, transport = report.get("expected_fabric"), report.get("nccl_transport")
    if report.get("device", "cpu").startswith("cuda"):
        if expected and transport and expected != transport:
            found["distributed"].append(f"the site expects {expected} but NCCL uses "
                                        f"{transport}; see docs/admin.md#nccl-profiles")
        if expected and not transport:
            found["distributed"].append(
                f"the site expects {expected}; NCCL's transport is unknown (NCCL_DEBUG was "
                "set by the job, so its log went elsewhere)")
        if report.get("bf16") and not report.get("bf16_supported"):
            found["precision"].append("training.bf16 is on but this GPU has no bf16 support")
        if (report.get("placement") or {}).get("cpu_count") == 1:
            found["distributed"].append(
                "the rank has 1 CPU for its GPU (loader, NCCL proxy, checkpoint thread share "
                "it): no CPUs per task reached srun; see docs/admin.md#first-run-on-a-new-cluster")
    elif report.get("gpus_requested"):
        found["kernels"].append(f"{report['gpus_requested']} GPUs per node were requested but "
                                "the rank runs on the CPU (a CPU-only torch build?)")
    sdpa = _sdpa_warning(report)
    if sdpa:
        found["kernels"].append(sdpa)
    return found


def mismatches(report: Mapping) -> list[str]:
    """Every warning for one rank's report (status shows them, the worker logs them)."""
    return [w for ws in layer_warnings(report).values() for w in ws]


def summarize(reports: list[Mapping]) -> list[str]:
    """A few lines for `status`: what ran (grouped when ranks agree) and the warnings."""
    if not reports:
        return []
    first = reports[0]
    lanes = ", ".join(f"{k} {v}" for k, v in sorted(first.get("lanes", {}).items()))
    line = f"{first.get('device_type', '?')} ({len(reports)} rank(s)); lanes: {lanes}"
    if first.get("nccl_version"):
        line += f"; NCCL {first['nccl_version']} over {first.get('nccl_transport') or '?'}"
    if first.get("expected_fabric"):
        line += f" (site: {first['expected_fabric']})"
    sdpa = [k for k, on in sorted(first.get("sdpa", {}).items()) if on]
    line += (f"; bf16 {'on' if first.get('bf16') else 'off'}; compile "
             f"{'on' if first.get('compile') else 'off'}; SDPA {'+'.join(sdpa) or 'none'}")
    if first.get("float8", "off") != "off":
        line += f"; float8 {first['float8']}"
    warnings = sorted({f"rank {r.get('rank')}: {w}" for r in reports for w in mismatches(r)})
    placed = placement_summary(reports)
    return [line] + ([placed] if placed else []) + [f"warning: {w}" for w in warnings]


def placement_summary(reports: list[Mapping]) -> Optional[str]:
    """Where the ranks run, ranks that got alike grouped: 'placement: 8 rank(s) with 12
    CPUs, 12 threads, bound by plan' (each rank's CPUs are in its report)."""
    groups = Counter((p["cpu_count"], p["threads"], p["bound_by"])
                     for r in reports if (p := r.get("placement")))
    return "placement: " + "; ".join(
        f"{n} rank(s) with {c} CPUs, {t} threads, bound by {by}"
        for (c, t, by), n in sorted(groups.items())) if groups else None


def read_reports(log_dir: Path) -> list[dict]:
    reports = []
    for path in sorted(log_dir.glob(REPORT_GLOB)):
        try:
            reports.append(json.loads(read_run_text(path)))  # never blocks on a FIFO
        except (OSError, ValueError, RecursionError, UserError):  # damaged: not a report
            continue
    return sorted(reports, key=lambda r: r.get("rank", 0))


def newest_reports(attempts: list[Path]) -> tuple[Optional[str], list[dict]]:
    """The reports of the newest attempt (`attempts` oldest first, storage.attempts) that
    wrote any: (attempt, reports)."""
    dirs = [d for d in attempts if any(d.glob(REPORT_GLOB))]
    return (dirs[-1].name, read_reports(dirs[-1])) if dirs else (None, [])


def nccl_log_env(log_dir: Path, rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """NCCL's init log into the attempt's directory, so the report can read the transport;
    nothing when the job chose its own NCCL_DEBUG."""
    if environ.get("NCCL_DEBUG"):
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": str(log_dir / NCCL_LOG_NAME.format(rank=rank))}


def gather(rank: int, device, lane_backends: Mapping[str, str], bf16: bool,
           environ: Mapping[str, str], nccl_log: Optional[Path],
           compiled: bool = False, started: str = "fresh") -> dict:
    """This rank's report, from torch and the environment; `compiled`: training.compile
    (the blocks torch.compile wraps); `started`: forked from the local launcher, or fresh."""
    import torch

    from enn_cluster.config import nccl

    cuda = device.type == "cuda"
    report = {
        "rank": rank, "device": str(device), "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "lanes": dict(lane_backends),
        "bf16": bool(bf16),
        "bf16_supported": bool(torch.cuda.is_bf16_supported()) if cuda else True,
        "compile": bool(compiled), "worker_start": started,
        "sdpa": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                 "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                 "math": torch.backends.cuda.math_sdp_enabled()},
        "nccl_profile": environ.get(nccl.PROFILE_VAR, "auto"),
        "nccl_version": None, "nccl_transport": None, "expected_fabric": None,
        "gpus_requested": gpus_requested(environ),
    }
    if cuda:
        report.update(fabric_fields(environ, nccl_log,
                                    ".".join(map(str, torch.cuda.nccl.version()))))
    return report


def gpus_requested(environ: Mapping[str, str]) -> int:
    """GPUs per node the job asked for: Slurm's grant, else what the local launcher was
    asked (its ranks run on the CPU where this machine has none); 0 when unreadable."""
    from enn_cluster.config.launch_env import GPUS_REQUESTED_VAR

    for name in ("SLURM_GPUS_ON_NODE", GPUS_REQUESTED_VAR):
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def fabric_fields(environ: Mapping[str, str], nccl_log: Optional[Path],
                  linked_version: Optional[str]) -> dict:
    """A GPU rank's NCCL version and transport (from NCCL's init log; the version torch
    links as the fallback) and the fabric the site expected (its profile, else detection)."""
    from enn_cluster.config import nccl

    lines = _read_lines(nccl_log)
    try:
        detected = nccl.detect_fabric(environ=environ)
    except Exception:  # a bad ENN_FABRIC was reported when the profile was applied
        detected = None
    return {"nccl_version": nccl_version_from_log(lines) or linked_version,
            "nccl_transport": nccl_transport(lines),
            "expected_fabric": expected_fabric(environ.get(nccl.PROFILE_VAR, "auto"),
                                               detected)}


def _read_lines(path: Optional[Path]) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines() if path else []
    except OSError:
        return []


def write_report(log_dir: Path, report: Mapping) -> Path:
    from enn_cluster.storage.rundir import atomic_write_text

    path = log_dir / f"backend-rank-{report['rank']}.json"
    atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True))
    return path
