"""Stage input arrays once into numpy memmaps in the run directory, with a manifest.

Workers then open the same files read-only with `np.load(mmap_mode="r")`: no task holds
the data set in memory, and every task of every restart reads identical bytes. Sources
are numpy arrays, `.npy`/`.npz` paths or any fsspec URL: a local `.npy` is copied in
the kernel (copy_file_range), anything else is streamed. Opening sources, and checking
them before the run directory exists, is `storage.data_sources`.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, TextIO

import numpy as np


from enn_cluster.config.run_config import DataConfig, ModelConfig, SyntheticConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import RunningChecksum
from enn_cluster.storage.data_sources import local_path, open_npy_stream
from enn_cluster.storage.file_copy import kernel_copy
from enn_cluster.storage.memmap_writer import (
    MANIFEST,
    held_out_rows,
    write_manifest,
    write_memmap,
)
from enn_cluster.storage.npy_header import check_layout, read_header
from enn_cluster.storage.rundir import atomic_write_text, fsync_dir
from enn_cluster.storage.run_files import read_run_text

_BLOCK = 16 << 20


def synthetic_arrays(cfg: SyntheticConfig, task: str) -> tuple[np.ndarray, np.ndarray]:
    """A smooth nonlinear target of Gaussian features: learnable, deterministic from seed."""
    rng = np.random.default_rng(cfg.seed)
    x = rng.standard_normal((cfg.n_samples, cfg.n_features), dtype=np.float32)
    w1 = rng.standard_normal((cfg.n_features, 32)).astype(np.float32) / np.sqrt(cfg.n_features)
    w2 = rng.standard_normal((32, cfg.n_outputs)).astype(np.float32) / np.sqrt(32)
    y = np.tanh(x @ w1) @ w2
    y += cfg.noise * rng.standard_normal(y.shape).astype(np.float32)
    if task == "classification":
        n_classes = max(cfg.n_outputs, 2)
        w3 = rng.standard_normal((cfg.n_outputs, n_classes)).astype(np.float32)
        return x, np.argmax(y @ w3, axis=1).astype(np.int64)
    return x, y.astype(np.float32)


# ---------------------------------------------------------------------------------------
# Copying into a memmap: in the kernel from a local .npy, streamed from anything else


def _layout(fh, source: str) -> tuple[tuple, np.dtype]:
    shape, fortran, dtype = read_header(fh, "input", source)
    check_layout("input", source, shape, fortran, dtype, None)
    return tuple(shape), np.dtype(dtype)


def _bytes(out: np.ndarray) -> np.ndarray:
    return out.reshape(-1).view(np.uint8)


def _stage_ndarray(arr: np.ndarray, dest: Path, progress: Optional[TextIO]) -> dict:
    check_layout("input", "the array given", tuple(arr.shape), False, arr.dtype, None)
    def fill(out: np.memmap, running: RunningChecksum) -> None:
        src, flat = _bytes(arr), _bytes(out)
        for start in range(0, src.size, _BLOCK):
            block = src[start:start + _BLOCK]
            flat[start:start + block.size] = block
            running.update(block)

    return write_memmap(dest, arr.shape, arr.dtype, fill, progress)


def _stage_local_npy(source: str, path: str, dest: Path, progress: Optional[TextIO]) -> dict:
    """Data bytes copied in the kernel; each block is checksummed from the destination's
    pages on one helper thread (in order) while the kernel copies the next."""
    with open(path, "rb") as fh:
        shape, dtype = _layout(fh, source)
        start = fh.tell()

        def fill(out: np.memmap, running: RunningChecksum) -> None:
            flat, pending = _bytes(out), []
            with open(out.filename, "rb+") as fo, ThreadPoolExecutor(1) as hasher:
                done = kernel_copy(fh.fileno(), fo.fileno(), start, out.offset, flat.size,
                                   lambda pos, n: pending.append(
                                       hasher.submit(running.update, flat[pos:pos + n])))
                for job in pending:
                    job.result()
            if done < flat.size:
                raise UserError(f"{source}: file is truncated ({done} of {flat.size} bytes)")

        return write_memmap(dest, shape, dtype, fill, progress)


def _stage_stream(source: str, key: Optional[str], dest: Path,
                  progress: Optional[TextIO]) -> dict:
    stream, closers, _ = open_npy_stream(source, key)
    try:
        shape, dtype = _layout(stream, source)

        def fill(out: np.memmap, running: RunningChecksum) -> None:
            flat, pos = _bytes(out), 0
            while pos < flat.size:
                block = stream.read(min(_BLOCK, flat.size - pos))
                if not block:
                    raise UserError(f"{source}: file is truncated ({pos} of {flat.size} bytes)")
                flat[pos:pos + len(block)] = np.frombuffer(block, np.uint8)
                running.update(block)
                pos += len(block)

        return write_memmap(dest, shape, dtype, fill, progress)
    finally:
        for c in closers:
            c.close()


def _list_array(rows, name: str) -> np.ndarray:
    """A list of rows as an array; rows of different lengths are refused, not taken for a
    path (or for an array of Python objects)."""
    try:
        arr = np.asarray(rows)
    except ValueError:  # numpy refuses an inhomogeneous list
        arr = None
    if arr is None or arr.dtype.kind == "O":
        raise UserError(f"{name}: a list whose rows differ in length (or hold other than "
                        "numbers); give rows of equal length, or a numpy array")
    return arr


def stage_array(source: Any, dest: Path, key: Optional[str] = None,
                progress: Optional[TextIO] = None) -> dict:
    """Copy one array (ndarray, tensor, .npy/.npz path or URL) to `dest` as a memmap;
    `progress` (a stream such as stderr) gets a progress bar. The entry's checksum
    covers the data bytes only, whichever way they came."""
    if hasattr(source, "detach"):  # torch tensor, without importing torch here
        source = source.detach().cpu().numpy()
    if isinstance(source, (list, tuple)):
        source = _list_array(source, dest.stem)
    if isinstance(source, np.ndarray):
        entry = _stage_ndarray(np.ascontiguousarray(source), dest, progress)
        entry["source"] = "<array>"
        return entry
    if not isinstance(source, (str, os.PathLike)):
        raise UserError(f"{dest.stem}: a {type(source).__name__} is neither an array nor a "
                        "path; give a numpy array, a tensor or a .npy/.npz path")
    source = str(source)
    if source.endswith(".npz"):
        entry = _stage_stream(source, key, dest, progress)
        entry["source"] = f"{source}#{key}"
        return entry
    local = local_path(source)
    if local is not None:
        entry = _stage_local_npy(source, local, dest, progress)
    else:
        entry = _stage_stream(source, None, dest, progress)
    entry["source"] = source
    return entry


# ---------------------------------------------------------------------------------------
# Staging a run's data set


def _target_scaler(y: np.ndarray) -> dict:
    """Per-output mean/std in float64, in blocks over the memmap: the mean first, then the
    squared deviations from it (E[y^2] - E[y]^2 cancels to noise when targets vary little
    around a large mean: 3 +- 1e-7 lost a tenth of its variance that way)."""
    flat = y.reshape(len(y), -1)
    n, blocks = max(len(flat), 1), range(0, len(flat), 65536)
    mean = sum((flat[i:i + 65536].astype(np.float64).sum(0) for i in blocks),
               np.zeros(flat.shape[1])) / n
    var = sum((((flat[i:i + 65536].astype(np.float64) - mean) ** 2).sum(0) for i in blocks),
              np.zeros(flat.shape[1])) / n
    std = np.sqrt(var)
    return {"mean": mean.tolist(), "std": np.where(std > 0, std, 1.0).tolist()}


def stage_run_data(data: DataConfig, model: ModelConfig, data_dir: Path,
                   arrays: Optional[dict] = None, progress: Optional[TextIO] = None,
                   text: bool = False) -> dict:
    """Stage train (and eval) arrays; `arrays` (x, y, eval_x, eval_y) override the config.
    `text` (the model's kind says: a causal LM's text files): tokenized into token memmaps
    (storage.text_staging)."""
    if text:
        from enn_cluster.storage.text_staging import stage_text_data

        return stage_text_data(data, model, data_dir, progress)
    arrays = dict(arrays or {})
    entries: dict = {}
    if "x" not in arrays and data.train_path == "synthetic":
        arrays["x"], arrays["y"] = synthetic_arrays(data.synthetic, model.task)
    sources = {
        "train_x": arrays.get("x", _src(data.train_path, data.x_key)),
        "train_y": arrays.get("y", _src(data.train_targets_path or data.train_path, data.y_key)),
        "eval_x": arrays.get("eval_x", _src(data.eval_path, data.x_key)),
        "eval_y": arrays.get("eval_y", _src(data.eval_targets_path or data.eval_path, data.y_key)),
    }
    for name, src in sources.items():
        if src is None or (isinstance(src, tuple) and src[0] is None):
            continue
        if isinstance(src, tuple):
            entries[name] = stage_array(src[0], data_dir / f"{name}.npy", key=src[1],
                                        progress=progress)
        else:
            entries[name] = stage_array(src, data_dir / f"{name}.npy", progress=progress)
    if not data.allow_nonfinite:
        for name in entries:
            check_finite(name, entries[name], np.load(data_dir / f"{name}.npy", mmap_mode="r"))
    n = entries["train_x"]["shape"][0]
    if entries["train_y"]["shape"][0] != n:
        raise UserError(f"data: train inputs have {n} rows but targets have "
                        f"{entries['train_y']['shape'][0]}; they must match")
    manifest = {"entries": entries, **held_out_rows(n, data.eval_fraction, "eval_x" in entries)}
    n_eval_held = n - manifest["train_rows"][1]
    if model.task == "classification":
        y = np.load(data_dir / "train_y.npy", mmap_mode="r")
        manifest["n_classes"] = int(max(int(y[i:i + 65536].max()) for i in range(0, len(y), 65536))) + 1
    if data.normalize_targets and model.task == "regression":
        y = np.load(data_dir / "train_y.npy", mmap_mode="r")
        manifest["target_scaler"] = _target_scaler(y[: n - n_eval_held])
    write_manifest(data_dir, manifest)
    return manifest


def check_finite(name: str, entry: dict, arr: np.ndarray, block_rows: int = 65536) -> None:
    """Refuse NaN or inf in a staged float array, naming the array, the first column that
    holds one and how many rows do (a model trains on them without a word: all-NaN inputs
    end 'training done')."""
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.complexfloating)):
        return
    flat = arr.reshape(len(arr), -1) if arr.ndim else arr.reshape(1, 1)
    rows, column = 0, None
    for start in range(0, len(flat), block_rows):
        bad = ~np.isfinite(flat[start:start + block_rows])
        rows += int(bad.any(axis=1).sum())
        if column is None and bad.any():
            column = int(np.flatnonzero(bad.any(axis=0))[0])
    if rows:
        raise UserError(f"data: {name} ({entry.get('source')}) has {rows} row(s) holding NaN "
                        f"or inf (the first in column {column}); clean them, or set "
                        "data.allow_nonfinite: true to stage them as they are")


def _src(path: Optional[str], key: str):
    if path is None or path == "synthetic":
        return None
    return (path, key) if path.endswith(".npz") else path


def read_manifest(data_dir: Path) -> dict:
    """The staged data's manifest; a missing or hand-edited one is one line, not a traceback."""
    path = Path(data_dir) / MANIFEST
    try:
        manifest = json.loads(read_run_text(path, field="data/manifest.json"))
    except FileNotFoundError:
        raise UserError(f"data/manifest.json: {path} is missing; the run's staged data is "
                        "incomplete: make the run again") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), dict):
        raise UserError(f"data/manifest.json: {path} is not a manifest enn-submit wrote; "
                        "make the run again")
    return manifest


def open_array(data_dir: Path, name: str) -> np.ndarray:
    return np.load(Path(data_dir) / f"{name}.npy", mmap_mode="r")
