"""Prediction chunks and their manifest: the plan, the records, the checks. Pure data, but
`verify_chunks`, which checksums the chunk files against their records.

The input's rows are cut into fixed-size chunks planned once for the whole input, so a
prediction stopped at one world size continues at another: a rank owns a contiguous
range of chunks, skips those already committed and writes the rest. A chunk is committed
when `chunk-<i>.json` (written after the chunk's `.npy`, both by rename) names its rows,
shape, dtype and checksum. Rank 0 writes `manifest.json` once every chunk is committed.
No torch and no numpy-heavy work here: the client verifies and assembles with this module.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import file_checksum
from enn_cluster.storage.prediction_collapse import collapsed_outputs
from enn_cluster.storage.run_files import read_run_text

REQUEST = "request.json"  # name, checkpoint step, input entry, chunk plan (client-written)
MANIFEST = "manifest.json"  # the committed prediction (rank 0, after every rank finished)
INPUT = "input.npy"
# per-output statistics (mean, std, min, max, non-finite) cover at most a row's first this
# many values: a language model's logits are [tokens x vocab] per row, whose lists would
# make every chunk record and the manifest tens of MB
STATS_OUTPUTS = 1024
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def read_record(path: Path) -> dict:
    """A JSON object of a prediction directory (request.json, chunk-<i>.json), read as a
    run file: UserError naming it when it is not one; FileNotFoundError when missing."""
    path = Path(path)
    try:
        record = json.loads(read_run_text(path))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        record = None
    if not isinstance(record, dict):
        raise UserError("{name}: {path} is not a JSON object (damaged or hand-edited)",
                        name=path.name, path=path, other=INPUTS["name"],
                        fix="start the prediction again under another {other}")
    return record


def read_request(pdir: Path) -> dict:
    return read_record(Path(pdir) / REQUEST)


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def stem(self) -> str:
        return f"chunk-{self.index:06d}"


def check_name(name: str) -> str:
    """`name`, a prediction's folder name; ValueError (the text after the input's name)."""
    if not _NAME_RE.match(name or ""):
        raise ValueError(f"{name!r} must be letters, digits, '.', '_' or '-' "
                         "(at most 128, not starting with a dot or dash)")
    return name


def plan_chunks(n_rows: int, chunk_rows: int) -> list[ChunkSpec]:
    """Fixed-size chunks covering [0, n_rows) in order; the last may be short."""
    if chunk_rows < 1:
        raise ValueError("--chunk-rows: must be >= 1")
    return [ChunkSpec(i, start, min(start + chunk_rows, n_rows))
            for i, start in enumerate(range(0, n_rows, chunk_rows))]


def chunks_for_rank(chunks: list[ChunkSpec], rank: int, world: int) -> list[ChunkSpec]:
    """A contiguous range of chunks per rank, sizes differing by at most one chunk."""
    per, extra = divmod(len(chunks), world)
    begin = rank * per + min(rank, extra)
    return chunks[begin:begin + per + (1 if rank < extra else 0)]


def chunk_record(spec: ChunkSpec, *, shape: Iterable[int], dtype: str, checksum: str,
                 nbytes: int, rank: int, stats: dict) -> dict:
    return {"index": spec.index, "file": f"{spec.stem}.npy", "rows": [spec.start, spec.stop],
            "shape": list(shape), "dtype": dtype, "checksum": checksum, "nbytes": nbytes,
            "rank": rank, "stats": stats}


def coverage_problems(records: list[dict], n_rows: int) -> list[str]:
    """Every row in exactly one chunk: gaps, overlaps and overruns, each named."""
    problems, pos = [], 0
    for rec in sorted(records, key=lambda r: (r["rows"][0], r["rows"][1])):
        start, stop = rec["rows"]
        if rec["shape"] and rec["shape"][0] != stop - start:
            problems.append(f"{rec['file']}: shape {rec['shape']} does not match rows "
                            f"{start}-{stop}")
        if start > pos:
            problems.append(f"rows {pos}-{start}: missing (no committed chunk)")
        elif start < pos:
            problems.append(f"{rec['file']}: rows {start}-{min(stop, pos)} duplicated")
        pos = max(pos, stop)
    if pos < n_rows:
        problems.append(f"rows {pos}-{n_rows}: missing (no committed chunk)")
    elif pos > n_rows:
        problems.append(f"rows {n_rows}-{pos}: beyond the input's {n_rows} rows")
    return problems


def verify_chunks(pdir: Path, manifest: dict) -> list[str]:
    """Coverage, sizes and checksums of a committed prediction, without assembling it."""
    problems = coverage_problems(manifest["chunks"], manifest["n_rows"])
    for rec in manifest["chunks"]:
        try:
            size, checksum = file_checksum(pdir / rec["file"], like=rec["checksum"])
        except FileNotFoundError:
            problems.append(f"{rec['file']}: missing")
            continue
        except (ValueError, UserError) as exc:  # an unknown checksum algorithm, a FIFO
            problems.append(f"{rec['file']}: {exc}")
            continue
        if size != rec["nbytes"] or checksum != rec["checksum"]:
            problems.append(f"{rec['file']}: does not match its record (corrupt or truncated)")
    return problems


# ---------------------------------------------------------------------------------------
# Per-output statistics: computed per chunk by the workers, merged here (Chan et al.)


def merge_stats(parts: list[dict]) -> Optional[dict]:
    """Merge per-chunk {count, mean, m2, min, max, nonfinite} lists into one summary."""
    parts = [p for p in parts if p and p.get("count")]
    if not parts:
        return None
    total = {"count": 0, "mean": [0.0] * len(parts[0]["mean"]),
             "m2": [0.0] * len(parts[0]["mean"]), "min": list(parts[0]["min"]),
             "max": list(parts[0]["max"]), "nonfinite": [0] * len(parts[0]["mean"])}
    for p in parts:
        n_a, n_b = total["count"], p["count"]
        n = n_a + n_b
        for j in range(len(total["mean"])):
            delta = p["mean"][j] - total["mean"][j]
            total["mean"][j] += delta * n_b / n
            total["m2"][j] += p["m2"][j] + delta * delta * n_a * n_b / n
            total["min"][j] = min(total["min"][j], p["min"][j])
            total["max"][j] = max(total["max"][j], p["max"][j])
            total["nonfinite"][j] += p["nonfinite"][j]
        total["count"] = n
    total["std"] = [math.sqrt(max(m2, 0.0) / total["count"]) for m2 in total["m2"]]
    return total


def collapse_warnings(stats: Optional[dict], scale: Optional[list[float]] = None) -> list[str]:
    """Outputs that are near-constant across samples (std tiny against the output's scale).

    `scale` is the training targets' std where a scaler exists; otherwise the output's own
    magnitude is the reference. A constant output has std 0 and always warns.
    """
    return [f"output {j}: near-constant across {stats['count']} samples "
            f"(std {stats['std'][j]:.3g}, mean {stats['mean'][j]:.6g})"
            for j in collapsed_outputs(stats, scale)]


def summary_lines(manifest: dict) -> list[str]:
    """What `collect` prints about a prediction besides the rows."""
    lines = []
    check = manifest.get("precision_check") or {}
    if check.get("reduced_precision") and "max_abs_diff" in check:
        lines.append(f"first batch in {check['dtype']}: max |fp32 - {check['dtype']}| = "
                     f"{check['max_abs_diff']:.3g}")
    elif check.get("reduced_precision"):  # a causal LM's scores: no fp32 replica beside it
        lines.append(f"predicted in {check['dtype']}")
    stats = manifest.get("stats")
    if stats and any(stats["nonfinite"]):
        lines.append(f"non-finite values per output: {stats['nonfinite']}")
    return lines
