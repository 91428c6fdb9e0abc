"""Prediction collection (`enn_cluster.client.collect.collect`) vs a raw concatenation.

Setup (not timed): a run directory holding one committed prediction, written the way the
workers write it: `chunk-NNNNNN.npy` files (`np.lib.format.write_array` + fsync), their
records (`prediction_manifest.chunk_record` with `predict.chunk_stats`) and the manifest
(`predict.write_manifest`). No scaler (the default: normalize_targets off).

Per repeat, with the chunks' pages evicted (posix_fadvise DONTNEED) before each side and
the order alternating:

- ours: `collect(run, name, out)`: verify coverage, copy each chunk's data into the
  output .npy in the kernel (copy_file_range), checksum the whole chunk file (xxh3) from
  the page cache, fsync, rename.
- baseline: the same chunks' data bytes concatenated into one .npy (header written once,
  then `os.sendfile` from each chunk past its header) + fsync: no verification.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

from .measure import BenchContext, Result, drop_cache, settle, throughput, timed

MB = 1e6
NAME = "bench"


def _sizes(ctx: BenchContext) -> dict:
    # rows x outputs float32: 32 MB in 8 chunks (quick), 256 MB in 16 chunks
    if ctx.quick:
        return {"rows": 1 << 17, "outputs": 64, "chunk_rows": 1 << 14}
    return {"rows": 1 << 20, "outputs": 64, "chunk_rows": 1 << 16}


def _make_prediction(ctx: BenchContext, s: dict):
    import numpy as np

    from enn_cluster.storage import prediction_manifest as pm
    from enn_cluster.worker.predict import chunk_stats, write_manifest
    from enn_cluster.storage.rundir import RunDir, atomic_write_text
    from enn_cluster.storage.checksum import file_checksum

    run = RunDir(ctx.workdir / "collect" / "run")
    pdir = run.predictions / NAME
    pdir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    request = {"name": NAME, "step": 1, "chunk_rows": s["chunk_rows"],
               "output_shape": [s["outputs"]], "scaler": None,
               "input": {"shape": [s["rows"], 16], "dtype": "<f4"}}
    atomic_write_text(pdir / pm.REQUEST, json.dumps(request, indent=1, sort_keys=True))
    for spec in pm.plan_chunks(s["rows"], s["chunk_rows"]):
        raw = rng.standard_normal((spec.rows, s["outputs"]), dtype=np.float32)
        path = pdir / f"{spec.stem}.npy"
        with open(path, "wb") as fh:
            np.lib.format.write_array(fh, raw, allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        size, checksum = file_checksum(path)
        rec = pm.chunk_record(spec, shape=raw.shape, dtype=raw.dtype.str, checksum=checksum,
                              nbytes=size, rank=0, stats=chunk_stats(raw))
        atomic_write_text(pdir / f"{spec.stem}.json", json.dumps(rec, sort_keys=True))
    manifest = write_manifest(pdir, request, s["rows"], world_size=1)
    return run, pdir, manifest


def raw_concatenate(files: list[Path], out: Path, shape: tuple, dtype) -> None:
    """Header once, then every chunk's data bytes in order (kernel copy), then fsync."""
    import numpy as np

    with open(out, "wb") as fo:
        np.lib.format.write_array_header_1_0(
            fo, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                 "fortran_order": False, "shape": shape})
        fo.flush()
        for path in files:
            with open(path, "rb") as fi:
                if np.lib.format.read_magic(fi) == (1, 0):
                    np.lib.format.read_array_header_1_0(fi)
                else:
                    np.lib.format.read_array_header_2_0(fi)
                offset, end = fi.tell(), os.fstat(fi.fileno()).st_size
                while offset < end:
                    sent = os.sendfile(fo.fileno(), fi.fileno(), offset, end - offset)
                    if sent == 0:
                        raise OSError(f"{path}: short read")
                    offset += sent
        os.fsync(fo.fileno())


def run(ctx: BenchContext) -> Result:
    import numpy as np

    from enn_cluster.client.collect import collect

    s = _sizes(ctx)
    run_dir, pdir, manifest = _make_prediction(ctx, s)
    chunks = [pdir / r["file"] for r in sorted(manifest["chunks"], key=lambda r: r["rows"][0])]
    nbytes = sum(p.stat().st_size for p in chunks)
    shape = (manifest["n_rows"], *manifest["output_shape"])
    ctx.log(f"collect: {nbytes / MB:.0f} MB in {len(chunks)} chunks, {ctx.repeats} repeats")
    out_dir = ctx.workdir / "collect" / "out"
    out_dir.mkdir()
    raw_s, ours_s = [], []
    for i in range(ctx.repeats):
        ours_out, raw_out = out_dir / f"collected-{i}.npy", out_dir / f"raw-{i}.npy"

        def ours() -> None:
            ours_s.append(timed(lambda: collect(run_dir, NAME, str(ours_out),
                                                stream=io.StringIO())))

        def raw() -> None:
            raw_s.append(timed(lambda: raw_concatenate(chunks, raw_out, shape,
                                                       manifest["dtype"])))

        for fn in ((raw, ours) if i % 2 == 0 else (ours, raw)):
            drop_cache(chunks)
            settle()
            fn()
        if i == 0 and not np.array_equal(np.load(ours_out, mmap_mode="r"),
                                         np.load(raw_out, mmap_mode="r")):
            raise RuntimeError("collect and the raw concatenation disagree")
        ours_out.unlink()
        raw_out.unlink()
    return throughput(
        "collect", "collect vs raw concatenation", ">=", 0.8, nbytes,
        ("collect: verify + copy_file_range + xxh3 of each chunk + fsync + rename", ours_s),
        ("sendfile each chunk's data after one header + fsync", raw_s),
        f"{nbytes / MB:.0f} MB float32 ({shape[0]} x {shape[1]}) in {len(chunks)} chunks; "
        "chunk pages evicted before each side; repeats alternate order")
