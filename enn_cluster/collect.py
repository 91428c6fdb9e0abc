"""Client side: verify a committed prediction and assemble its rows in input order.

One pass over the chunks: each is read once, checksummed while its bytes are copied into
an output memmap under a temporary name, and only when every chunk verified and every
row is covered exactly once is the result renamed to (or uploaded as) `--out`. On any
problem nothing is written there, and the error lists every bad or missing chunk.
Memory stays at one block, whatever the size of the output. No torch.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

import numpy as np

from . import prediction_manifest as pm
from .checksum import RunningChecksum, algorithm_of, file_checksum
from .errors import UserError
from .progress import ProgressBar
from .rundir import RunDir, fsync_dir
from .staging import read_npy_header

_BLOCK = 8 << 20


@dataclass
class CollectResult:
    out: str
    name: str
    shape: tuple
    step: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_prediction(run: RunDir, name: Optional[str]) -> str:
    """The named prediction, or the only one there is."""
    names = sorted(p.name for p in run.predictions.glob("*") if (p / pm.REQUEST).exists()) \
        if run.predictions.exists() else []
    if name is not None:
        if name not in names:
            raise UserError(f"--name: no prediction {name!r} in {run.predictions}; "
                            f"there are: {', '.join(names) or 'none'}")
        return name
    if len(names) != 1:
        raise UserError(f"--name: {run.path} has {len(names)} predictions "
                        f"({', '.join(names) or 'none'}); pass --name NAME")
    return names[0]


def read_committed(pdir: Path) -> dict:
    try:
        return json.loads((pdir / pm.MANIFEST).read_text())
    except FileNotFoundError:
        done = len(list(pdir.glob("chunk-*.json")))
        request = json.loads((pdir / pm.REQUEST).read_text())
        total = len(pm.plan_chunks(request["input"]["shape"][0], request["chunk_rows"]))
        raise UserError(f"prediction {pdir.name}: not complete ({done} of {total} chunks "
                        f"committed); continue it with 'enn-submit predict "
                        f"{pdir.parent.parent} --name {pdir.name}'")


def verify_chunks(pdir: Path, manifest: dict) -> list[str]:
    """Coverage, sizes and checksums of a committed prediction, without assembling it."""
    problems = pm.coverage_problems(manifest["chunks"], manifest["n_rows"])
    for rec in manifest["chunks"]:
        try:
            size, checksum = file_checksum(pdir / rec["file"], like=rec["checksum"])
        except FileNotFoundError:
            problems.append(f"{rec['file']}: missing")
            continue
        if size != rec["nbytes"] or checksum != rec["checksum"]:
            problems.append(f"{rec['file']}: does not match its record (corrupt or truncated)")
    return problems


def _copy_chunk(path: Path, rec: dict, dest: np.ndarray, bar: ProgressBar) -> Optional[str]:
    """Stream one chunk file into `dest` (its rows, as bytes); a problem, or None."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return f"{rec['file']}: missing"
    with fh:
        try:
            shape, fortran, dtype = read_npy_header(fh)
        except (ValueError, OSError) as exc:
            return f"{rec['file']}: unreadable header ({exc})"
        if list(shape) != rec["shape"] or np.dtype(dtype).str != rec["dtype"] or fortran:
            return f"{rec['file']}: holds {shape} {dtype}, its record says {rec['shape']} {rec['dtype']}"
        offset = fh.tell()
        fh.seek(0)
        running = RunningChecksum(algorithm_of(rec["checksum"]))
        running.update(fh.read(offset))
        bar.update(offset)
        flat, pos = dest.reshape(-1).view(np.uint8), 0
        while True:
            block = fh.read(_BLOCK)
            if not block:
                break
            running.update(block)
            end = min(pos + len(block), flat.size)
            flat[pos:end] = np.frombuffer(block, np.uint8)[:end - pos]
            pos += len(block)
            bar.update(len(block))
        size = offset + pos
    if size != rec["nbytes"] or running.hexdigest() != rec["checksum"]:
        return (f"{rec['file']}: {'size' if size != rec['nbytes'] else 'checksum'} "
                "does not match its record (corrupt or truncated)")
    return None


def _assemble(pdir: Path, manifest: dict, tmp: Path, raw: bool, stream) -> list[str]:
    shape = (manifest["n_rows"],) + tuple(manifest["output_shape"])
    problems = pm.coverage_problems(manifest["chunks"], manifest["n_rows"])
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.dtype(manifest["dtype"]),
                                    shape=shape)
    bar = ProgressBar(f"collect {pdir.name}", sum(r["nbytes"] for r in manifest["chunks"]),
                      stream=stream)
    scaler = None if raw else manifest.get("scaler")
    for rec in sorted(manifest["chunks"], key=lambda r: r["rows"][0]):
        start, stop = rec["rows"]
        if problems and any(rec["file"] in p for p in problems):
            continue
        region = out[start:stop]
        problem = _copy_chunk(pdir / rec["file"], rec, region, bar)
        if problem:
            problems.append(problem)
        elif scaler:
            flat = region.reshape(stop - start, -1)
            flat *= np.asarray(scaler["std"], flat.dtype)
            flat += np.asarray(scaler["mean"], flat.dtype)
    bar.close()
    out.flush()
    del out
    return problems


def _target(out: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(out)
    local = type(fs).__name__ == "LocalFileSystem"
    return fs, path, local


def collect(run: RunDir, name: Optional[str], out: str, *, raw: bool = False,
            overwrite: bool = False, stream: Optional[TextIO] = None) -> CollectResult:
    """Verify and assemble prediction `name` of `run` into `out` (.npy path or fsspec URL)."""
    name = find_prediction(run, name)
    pdir = run.predictions / name
    manifest = read_committed(pdir)
    if not str(out).endswith(".npy"):
        raise UserError(f"--out: {out!r} must end in .npy (local path or fsspec URL)")
    fs, path, local = _target(out)
    if fs.exists(path) and not overwrite:
        raise UserError(f"--out: {out} exists; choose another path or pass --overwrite")
    if local:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="enn-collect-")) / "out.npy"
    try:
        problems = _assemble(pdir, manifest, tmp, raw, stream)
        if problems:
            raise UserError(f"collect {name}: {len(problems)} problem(s), nothing written to "
                            f"{out}: " + "; ".join(problems) +
                            f". Recompute them with 'enn-submit predict {run.path} --name {name}'")
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if local:
            os.replace(tmp, path)
            fsync_dir(Path(path).parent)
        else:
            fs.put_file(str(tmp), path)
    finally:
        tmp.unlink(missing_ok=True)
        if not local:
            tmp.parent.rmdir()
    scale = manifest["scaler"]["std"] if manifest.get("scaler") else None
    warnings = pm.collapse_warnings(manifest.get("stats"), scale)
    return CollectResult(str(out), name, (manifest["n_rows"], *manifest["output_shape"]),
                         manifest["step"], warnings, pm.summary_lines(manifest))
