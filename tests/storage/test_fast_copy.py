"""The in-kernel copy paths: staging a local .npy and collecting prediction chunks.

Both copy with copy_file_range (sendfile where refused) and checksum from the page cache;
their results must equal the streaming paths' byte for byte, checksum for checksum."""
import errno
import io
import json
import os

import numpy as np
import pytest

from enn_cluster.client import collect as col
from enn_cluster.storage import file_copy
from enn_cluster.storage import prediction_manifest as pm
from enn_cluster.storage import staging
from enn_cluster.storage.checksum import file_checksum
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import RunDir, atomic_write_text


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 KiB, so a small array crosses many of them."""
    monkeypatch.setattr(file_copy, "BLOCK", 4096)
    monkeypatch.setattr(staging, "_BLOCK", 4096)


@pytest.fixture
def copies(monkeypatch):
    """Counts the kernel copies, proving the fast path ran."""
    calls = []
    real = os.copy_file_range

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", spy)
    return calls


def test_local_npy_round_trip_matches_the_streaming_checksum(tmp_path, small_blocks, copies):
    import fsspec

    x = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    with fsspec.open("memory://bucket/fast.npy", "wb") as fh:
        np.save(fh, x)
    bar = _Tty()
    fast = staging.stage_array(str(tmp_path / "x.npy"), tmp_path / "fast.npy", progress=bar)
    assert len(copies) == -(-x.nbytes // 4096)
    streamed = staging.stage_array("memory://bucket/fast.npy", tmp_path / "streamed.npy")
    from_array = staging.stage_array(x, tmp_path / "array.npy")
    assert fast["checksum"] == streamed["checksum"] == from_array["checksum"]
    assert fast["checksum"].startswith("xxh3:") and fast["nbytes"] == x.nbytes
    assert {k: fast[k] for k in ("file", "shape", "dtype", "source")} == {
        "file": "fast.npy", "shape": [1000, 7], "dtype": "<f4", "source": str(tmp_path / "x.npy")}
    staged = np.load(tmp_path / "fast.npy", mmap_mode="r")
    assert isinstance(staged, np.memmap) and np.array_equal(staged, x)
    assert (tmp_path / "fast.npy").read_bytes() == (tmp_path / "streamed.npy").read_bytes()
    assert "100.0%" in bar.getvalue()  # the bar followed the copy to the end
    url = staging.stage_array("file://" + str(tmp_path / "x.npy"), tmp_path / "url.npy")
    assert url["checksum"] == fast["checksum"]


def test_refused_copy_file_range_falls_back_to_sendfile(tmp_path, small_blocks, monkeypatch):
    x = np.arange(5000, dtype=np.int64).reshape(1000, 5)
    np.save(tmp_path / "x.npy", x)

    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    entry = staging.stage_array(str(tmp_path / "x.npy"), tmp_path / "y.npy")
    assert np.array_equal(np.load(tmp_path / "y.npy"), x)
    assert entry["checksum"] == staging.stage_array(x, tmp_path / "z.npy")["checksum"]


def test_truncated_or_fortran_local_npy_is_refused_and_leaves_nothing(tmp_path, copies):
    np.save(tmp_path / "x.npy", np.ones((300, 4), np.float32))
    raw = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[:-7])
    with pytest.raises(UserError, match=r"cut.npy: file is truncated \(4793 of 4800 bytes\)"):
        staging.stage_array(str(tmp_path / "cut.npy"), tmp_path / "out.npy")
    assert copies  # it was the fast path that found it
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((3, 4), np.float32)))
    with pytest.raises(UserError, match="Fortran-ordered"):
        staging.stage_array(str(tmp_path / "f.npy"), tmp_path / "out.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.npy", "f.npy", "x.npy"]


# ---------------------------------------------------------------------------------------
# collect


def _prediction(tmp_path, scaler=None, rows=50, chunk_rows=8, outputs=3):
    run = RunDir(tmp_path / "run")
    pdir = run.predictions / "p"
    pdir.mkdir(parents=True)
    y = np.random.default_rng(1).standard_normal((rows, outputs)).astype(np.float32)
    request = {"name": "p", "step": 1, "chunk_rows": chunk_rows, "output_shape": [outputs],
               "scaler": scaler, "input": {"shape": [rows, 2], "dtype": "<f4"}}
    atomic_write_text(pdir / pm.REQUEST, json.dumps(request))
    records = []
    for spec in pm.plan_chunks(rows, chunk_rows):
        path = pdir / f"{spec.stem}.npy"
        np.save(path, y[spec.start:spec.stop])
        size, checksum = file_checksum(path)
        records.append(pm.chunk_record(spec, shape=(spec.rows, outputs), dtype="<f4",
                                       checksum=checksum, nbytes=size, rank=0, stats=None))
    manifest = {"name": "p", "step": 1, "n_rows": rows, "output_shape": [outputs],
                "dtype": "<f4", "chunk_rows": chunk_rows, "scaler": scaler,
                "input": request["input"], "chunks": records, "stats": None}
    atomic_write_text(pdir / pm.MANIFEST, json.dumps(manifest))
    return run, pdir, y


def test_collect_copies_in_the_kernel_and_applies_the_scaler(tmp_path, small_blocks, copies):
    scaler = {"mean": [1.0, -2.0, 0.5], "std": [2.0, 3.0, 0.25]}
    run, _, y = _prediction(tmp_path, scaler=scaler)
    col.collect(run, "p", str(tmp_path / "raw.npy"), raw=True, stream=io.StringIO())
    assert copies
    assert np.array_equal(np.load(tmp_path / "raw.npy", mmap_mode="r"), y)
    col.collect(run, "p", str(tmp_path / "y.npy"), stream=io.StringIO())
    want = y * np.float32(scaler["std"]) + np.float32(scaler["mean"])
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want.astype(np.float32))


def test_collect_names_every_bad_chunk_and_writes_nothing(tmp_path, copies):
    run, pdir, _ = _prediction(tmp_path)
    flipped = bytearray((pdir / "chunk-000001.npy").read_bytes())
    flipped[-3] ^= 0x40
    (pdir / "chunk-000001.npy").write_bytes(bytes(flipped))
    cut = pdir / "chunk-000003.npy"
    cut.write_bytes(cut.read_bytes()[:-8])
    (pdir / "chunk-000004.npy").unlink()
    manifest = json.loads((pdir / pm.MANIFEST).read_text())
    manifest["chunks"][5]["checksum"] = "sha9:0123"
    atomic_write_text(pdir / pm.MANIFEST, json.dumps(manifest))
    with pytest.raises(UserError) as err:
        col.collect(run, "p", str(tmp_path / "out.npy"), stream=io.StringIO())
    message = str(err.value)
    assert "4 problem(s)" in message
    assert "chunk-000001.npy: checksum does not match" in message
    assert "chunk-000003.npy: size does not match" in message
    assert "chunk-000004.npy: missing" in message
    assert "chunk-000005.npy: unknown checksum algorithm 'sha9'" in message
    assert copies  # the good chunks went through the kernel copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    problems = pm.verify_chunks(pdir, manifest)
    assert len(problems) == 4 and "unknown checksum algorithm" in problems[-1]
