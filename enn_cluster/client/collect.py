"""Client side: verify a committed prediction and assemble its rows in input order.

One pass over the chunks: each chunk's data is copied in the kernel (copy_file_range)
into the output .npy under a temporary name, then the whole chunk file is checksummed
from the page cache; only when every chunk verified and every row is covered exactly
once is the result renamed to (or uploaded as) `--out`. On any problem nothing is
written there, and the error lists every bad or missing chunk. No torch.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

import numpy as np

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError
from enn_cluster.storage import prediction_manifest as pm
from enn_cluster.storage.checksum import RunningChecksum, algorithm_of
from enn_cluster.storage.file_copy import kernel_copy
from enn_cluster.storage.npy_header import read_npy_header
from enn_cluster.storage.output_target import (
    check_local_target,
    expanded,
    missing_parents,
    remove_empty,
)
from enn_cluster.storage.prediction_collapse import recorded_verdict
from enn_cluster.storage.rundir import RunDir, fsync_dir
from enn_cluster.storage.memmap_writer import progress_bar
from enn_cluster.storage.run_files import open_run_file, read_run_text


NAME, OUT = INPUTS["name"], INPUTS["out"]
ASSEMBLED = ("assembled.npy", "assembled-raw.npy")  # the API's own outputs, in the prediction


@dataclass
class CollectResult:
    out: str
    name: str
    shape: tuple
    step: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    collapse: Optional[dict] = None  # the manifest's verdict on near-constant outputs


def find_prediction(run: RunDir, name: Optional[str]) -> str:
    """The named prediction, or the only one there is."""
    names = sorted(p.name for p in run.predictions.glob("*") if (p / pm.REQUEST).exists()) \
        if run.predictions.exists() else []
    if name is not None:
        if name not in names:
            raise UserError("no prediction {value!r} in {where}", field=NAME, value=name,
                            where=run.predictions, fix="there are: {names}",
                            names=", ".join(names) or "none")
        return name
    if not names:
        raise UserError("{value} has no predictions yet", field=INPUTS["run_dir"],
                        value=run.path, fix="make one with 'enn-submit predict {value} --input "
                        "X.npy', then collect it", api_fix="make one with predict()")
    if len(names) != 1:
        raise UserError("{run} has {count} predictions ({names})", field=NAME,
                        run=run.path, count=len(names), names=", ".join(names) or "none",
                        fix="pass {name}", name=Said(NAME, "NAME"))
    return names[0]


def read_committed(pdir: Path) -> dict:
    """The committed manifest, checked as data: its chunk files are plain names of this
    prediction, each named once, before any of them is opened."""
    where = pdir / pm.MANIFEST
    try:
        manifest = json.loads(read_run_text(where))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _recompute(f"{where}: not valid JSON (damaged or hand-edited)", pdir.name) from None
    except FileNotFoundError:
        done = len(list(pdir.glob("chunk-*.json")))
        request = pm.read_request(pdir)
        total = len(pm.plan_chunks(request["input"]["shape"][0], request["chunk_rows"]))
        raise UserError("prediction {name}: not complete ({done} of {total} chunks committed)",
                        name=pdir.name, done=done, total=total, run=pdir.parent.parent,
                        fix="continue it with 'enn-submit predict {run} --name {name}'",
                        api_fix="continue it with predict(..., name={name!r})")
    problem = manifest_problem(manifest)
    if problem:
        raise _recompute(f"{where}: {problem}", pdir.name)
    return manifest


def _recompute(problem: str, name: str) -> UserError:
    """A damaged prediction: computed again under its name."""
    return UserError("{problem}", problem=problem, name=name,
                     fix="recompute the prediction with 'enn-submit predict ... --name {name}'",
                     api_fix="recompute it under another name (predict(..., name=...))")


def manifest_problem(manifest) -> Optional[str]:
    """What makes a manifest unusable as data, or None. Pure."""
    if not isinstance(manifest, dict):
        return "not a manifest (a JSON object is expected)"
    chunks = manifest.get("chunks")
    if not isinstance(chunks, list) or not chunks or not all(isinstance(c, dict) for c in chunks):
        return "its 'chunks' is not a list of chunk records"
    if not isinstance(manifest.get("n_rows"), int) or not isinstance(manifest.get("output_shape"), list):
        return "its 'n_rows' or 'output_shape' is missing or not a number/list"
    seen: dict = {}
    for i, rec in enumerate(chunks):
        stem = f"chunk-{rec.get('index', i):06d}" if isinstance(rec.get("index", i), int) else f"chunk #{i}"
        name = rec.get("file")
        if not isinstance(name, str) or not re.fullmatch(r"chunk-[0-9]{6,}\.npy", name):
            return f"{stem}: its file {str(name)[:80]!r} is not a chunk of this prediction"
        if name in seen:
            return f"{stem}: its file {name} is also {seen[name]}'s (rows would repeat)"
        seen[name] = stem
    if len(chunks) != len({c.get("index") for c in chunks}):
        return "two records have one chunk index"
    rows = [c.get("rows") for c in chunks]
    if not all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)
               for r in rows):
        return "a chunk record's 'rows' is not [start, stop]"
    missing = pm.coverage_problems(chunks, manifest["n_rows"])
    if missing:
        return "; ".join(missing[:3])
    return None


def _checksum_file(fh, size: int, running: RunningChecksum) -> None:
    """Checksum a file through a read-only map: its pages are in the page cache."""
    with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as view:
            running.update(view)


def _copy_chunk(path: Path, rec: dict, out_fd: int, offset: int, room: int,
                bar) -> Optional[str]:
    """Copy one chunk's data (at most `room` bytes) to `offset` of the output in the
    kernel, then checksum the whole chunk file against its record; a problem, or None."""
    try:
        running = RunningChecksum(algorithm_of(rec["checksum"]))
    except ValueError as exc:
        return f"{rec['file']}: {exc}"
    try:
        with open_run_file(path, rec["file"]) as fh:
            try:
                shape, fortran, dtype = read_npy_header(fh)
            except (ValueError, OSError) as exc:
                return f"{rec['file']}: unreadable header ({exc})"
            if list(shape) != rec["shape"] or np.dtype(dtype).str != rec["dtype"] or fortran:
                return (f"{rec['file']}: holds {shape} {dtype}, its record says "
                        f"{rec['shape']} {rec['dtype']}")
            start, size = fh.tell(), os.fstat(fh.fileno()).st_size
            bar.update(start)
            kernel_copy(fh.fileno(), out_fd, start, offset, min(size - start, room),
                        lambda pos, n: bar.update(n))
            _checksum_file(fh, size, running)
    except FileNotFoundError:
        return f"{rec['file']}: missing"
    except UserError as exc:  # a FIFO, a device, a symlink, a directory
        return str(exc)
    if size != rec["nbytes"] or running.hexdigest() != rec["checksum"]:
        return (f"{rec['file']}: {'size' if size != rec['nbytes'] else 'checksum'} "
                "does not match its record (corrupt or truncated)")
    return None


def _assemble(pdir: Path, manifest: dict, tmp: Path, raw: bool, stream) -> list[str]:
    n = manifest["n_rows"]
    problems = pm.coverage_problems(manifest["chunks"], n)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.dtype(manifest["dtype"]),
                                    shape=(n,) + tuple(manifest["output_shape"]))
    row_bytes = out.itemsize * int(np.prod(out.shape[1:], dtype=np.int64))
    bar = progress_bar(f"collect {pdir.name}", sum(r["nbytes"] for r in manifest["chunks"]),
                       stream or sys.stderr)
    scaler = None if raw else manifest.get("scaler")
    with open(tmp, "rb+") as fo:
        for rec in sorted(manifest["chunks"], key=lambda r: r["rows"][0]):
            start, stop = (min(max(r, 0), n) for r in rec["rows"])
            if problems and any(rec["file"] in p for p in problems):
                continue
            problem = _copy_chunk(pdir / rec["file"], rec, fo.fileno(),
                                  out.offset + start * row_bytes, (stop - start) * row_bytes, bar)
            if problem:
                problems.append(problem)
            elif scaler and stop > start:  # the map sees what the kernel wrote
                flat = out[start:stop].reshape(stop - start, -1)
                flat *= np.asarray(scaler["std"], flat.dtype)
                flat += np.asarray(scaler["mean"], flat.dtype)
    bar.close()
    out.flush()
    del out
    return problems


def _target(out: str):
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(out)
    except (ValueError, ImportError) as exc:
        raise UserError("no storage for {scheme!r}:// here ({why})", field=OUT, value=out,
                        scheme=out.split("://")[0], why=str(exc)[:120],
                        fix="give a local path or an fsspec URL whose package is installed"
                        ) from None
    local = type(fs).__name__ == "LocalFileSystem"
    return fs, path, local


def collect(run: RunDir, name: Optional[str], out: str, *, raw: bool = False,
            overwrite: bool = False, stream: Optional[TextIO] = None) -> CollectResult:
    """Verify and assemble prediction `name` of `run` into `out` (.npy path or fsspec URL)."""
    from enn_cluster.config.checks import no_credentials_in_url

    no_credentials_in_url(OUT, str(out))
    if str(out).startswith("memory://"):
        raise UserError("memory:// is gone when enn-submit exits", field=OUT, value=out,
                        fix="give a file path or a URL of lasting storage")
    name = find_prediction(run, name)
    pdir = run.predictions / name
    manifest = read_committed(pdir)
    if not str(out).endswith(".npy"):
        raise UserError("{value!r} must end in .npy (local path or fsspec URL)", field=OUT,
                        value=out)
    fs, path, local = _target(expanded(OUT, out))
    if local:  # the API's default target, predictions/<name>/assembled*.npy, is the run's own
        own = Path(path).parent == Path(os.path.abspath(pdir)) and Path(path).name in ASSEMBLED
        check_local_target(OUT, path, overwrite, run_dir=None if own else run.path)
    elif fs.exists(path) and not overwrite:
        raise UserError("{value} exists", field=OUT, value=out,
                        fix="choose another path or pass --overwrite",
                        api_fix="choose another path")
    made: list[Path] = []  # the parents of --out this call creates: gone again on failure
    if local:
        made = missing_parents(Path(path))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="enn-collect-")) / "out.npy"
    done = False
    try:
        problems = _assemble(pdir, manifest, tmp, raw, stream)
        if problems:
            raise UserError("collect {name}: {count} problem(s), nothing written to {out}: "
                            "{problems}", name=name, count=len(problems), out=out,
                            problems="; ".join(problems), run=run.path,
                            fix="recompute them with 'enn-submit predict {run} --name {name}'",
                            api_fix="recompute them under another name (predict(..., "
                                    "name=...))")
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if local:
            os.replace(tmp, path)
            fsync_dir(Path(path).parent)
        else:
            fs.put_file(str(tmp), path)
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        if not local:
            tmp.parent.rmdir()
        if not done:
            remove_empty(made)
    scale = manifest["scaler"]["std"] if manifest.get("scaler") else None
    warnings = [] if manifest.get("generate") else pm.collapse_warnings(manifest.get("stats"), scale)
    return CollectResult(str(out), name, (manifest["n_rows"], *manifest["output_shape"]),
                         manifest["step"], warnings, pm.summary_lines(manifest),
                         recorded_verdict(manifest.get("collapse")))
