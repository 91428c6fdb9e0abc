"""DCP storage plumbing: the header-only layout parser, in-place reads, checksumming writes."""
from __future__ import annotations

import io
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from enn_cluster.storage import commits as store
from enn_cluster.storage import torch_save_layout as tsl
from enn_cluster.storage.checksum import file_checksum
from enn_cluster.storage.dcp_io import ChecksummingWriter, ShardVerifier, safe_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TENSORS = {
    "matrix": torch.randn(33, 17),
    "transposed": torch.randn(7, 5).t().contiguous().t(),  # strides (1, 7): not C-contiguous
    "bf16": torch.randn(9, 4).to(torch.bfloat16),
    "scalar": torch.tensor(2.5),
    "int64": torch.arange(11),
    "bool": torch.tensor([True, False, True]),
    "empty": torch.empty(0, 3),
}


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _data_offset(data: bytes) -> int:
    """Where data/0's bytes start, from the zip's own central directory (stdlib: the same
    answer on every torch release)."""
    import struct
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("name", [n for n in TENSORS if n != "empty"])
def test_layout_from_the_front_matches_torch_load(name):
    t = TENSORS[name]
    data = _saved(t)
    layout = tsl.parse(data[:4096])
    meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    assert layout is not None and layout.little_endian
    assert layout.data_start == _data_offset(data)
    assert meta.shape == t.shape and meta.dtype == t.dtype
    assert (layout.saved.shape, layout.saved.stride(), layout.saved.dtype) == \
        (t.shape, t.stride(), t.dtype)
    assert layout.nbytes == t.untyped_storage().nbytes()
    end = layout.data_start + layout.nbytes
    assert tsl.descriptor_ok(data[end:end + tsl.DESCRIPTOR_MAX], layout.nbytes)
    assert not tsl.descriptor_ok(data[end:end + tsl.DESCRIPTOR_MAX], layout.nbytes + 1)


def test_anything_unexpected_is_none_not_an_error():
    data = _saved(torch.ones(4))
    assert tsl.parse(b"") is None and tsl.parse(b"PK\x03\x04" + b"\0" * 100) is None
    assert tsl.parse(data[:60]) is None  # cut inside the pickle
    assert tsl.parse(data.replace(b"little", b"big\0\0\0")) is not None
    assert not tsl.parse(data.replace(b"little", b"bigend")).little_endian
    bad = bytearray(data)
    bad[8] = 8  # compression method: deflate
    assert tsl.parse(bytes(bad)) is None
    pickled = _saved({"not": "a tensor"})
    assert tsl.parse(pickled) is None


def _checkpoint(tmp_path):
    state = {k: v.clone() for k, v in TENSORS.items()}
    path = tmp_path / "ckpt"
    writer = ChecksummingWriter(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return state, path, writer


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_writer_checksums_what_it_wrote_and_stock_dcp_reads_it(tmp_path):
    state, path, writer = _checkpoint(tmp_path)
    shards = {name: rec for name, rec in writer.checksums.items() if name.endswith(".distcp")}
    assert shards and all(file_checksum(path / name) == (rec["size"], rec["checksum"])
                          for name, rec in shards.items())
    ours, theirs = _zeros(state), _zeros(state)
    safe_load(ours, path)
    dcp.load(theirs, checkpoint_id=str(path), no_dist=True)  # zip CRCs are off: still fine
    for key in state:
        assert torch.equal(ours[key], state[key]) and torch.equal(theirs[key], state[key]), key


def test_a_destination_of_another_dtype_gets_the_values_cast(tmp_path, caplog):
    """Prediction reads fp32 weights into bf16 replicas: each value is the cast of what was
    saved, in-place reads (contiguous) and DCP's own (strided, empty) alike."""
    state, path, _ = _checkpoint(tmp_path)
    floats = {k: v for k, v in state.items() if v.is_floating_point() and v.dtype != torch.bfloat16}
    loaded = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in floats.items()}
    with caplog.at_level(logging.WARNING, logger="enn_cluster.storage.dcp_io"):
        safe_load(loaded, path)
    assert "slow way" not in caplog.text
    for key, value in floats.items():
        assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], value.bfloat16()), key


def test_a_record_that_ends_elsewhere_is_read_the_slow_way(tmp_path, caplog):
    state, path, _ = _checkpoint(tmp_path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    first = data.find(b"PK\x07\x08", data.find(b"/data/0"))  # the first tensor's descriptor
    data[first + 8:first + 16] = b"\xff" * 8  # its recorded sizes now disagree
    shard.write_bytes(bytes(data))
    loaded = _zeros(state)
    with caplog.at_level(logging.WARNING, logger="enn_cluster.storage.dcp_io"):
        safe_load(loaded, path)
    assert "reading it the slow way" in caplog.text
    for key in state:
        assert torch.equal(loaded[key], state[key]), key


def test_a_truncated_shard_fails_loudly(tmp_path):
    state, path, _ = _checkpoint(tmp_path)
    shard = next(path.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(BaseException, match="truncated|early|EOF|size|failed"):
        safe_load(_zeros(state), path)


class _Plant:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_global_in_a_tensor_record_never_runs(tmp_path):
    import pickle

    sentinel = tmp_path / "PWNED"
    with pytest.raises(pickle.UnpicklingError):
        tsl._meta_tensor(io.BytesIO(pickle.dumps(_Plant(sentinel), protocol=2)))
    assert not sentinel.exists()


def _io_read_bytes() -> int:
    """Bytes this process has read through read-like syscalls (page cache or not)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def _verified_checkpoint(tmp_path):
    state = dict({k: v.clone() for k, v in TENSORS.items()}, big=torch.randn(1 << 21))
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=ChecksummingWriter(path), no_dist=True)
    record = {"files": store.checksum_files(path, store.step_files(path))}
    return state, path, record


def test_a_verified_load_reads_each_shard_once_and_checksums_all_of_it(tmp_path):
    """One pass: the shard's bytes are read once (rchar), its checksum is the whole
    file's, gaps between records and the zip directory at the end included."""
    state, path, record = _verified_checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    verifier = ShardVerifier(record, sorted(record["files"]), rank=0, world=1)
    assert verifier.mine == ["__0_0.distcp"]
    loaded = _zeros(state)
    before = _io_read_bytes()
    safe_load(loaded, path, verifier=verifier)
    read = _io_read_bytes() - before
    assert verifier.problems(path) == []
    assert verifier.found["__0_0.distcp"] == file_checksum(shard)
    size = shard.stat().st_size
    assert read < 1.1 * size + (path / ".metadata").stat().st_size, (read, size)
    for key in state:
        assert torch.equal(loaded[key], state[key]), key


@pytest.mark.parametrize("where", ["tensor data", "zip directory"])
def test_a_flipped_byte_anywhere_in_a_shard_fails_the_verified_load(tmp_path, where):
    state, path, record = _verified_checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    at = len(data) // 2 if where == "tensor data" else len(data) - 30  # 'big' fills the middle
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    verifier = ShardVerifier(record, sorted(record["files"]), rank=0, world=1)
    safe_load(_zeros(state), path, verifier=verifier)
    problems = verifier.problems(path)
    assert len(problems) == 1 and problems[0].startswith("__0_0.distcp: checksum"), problems


def test_shards_are_shared_out_by_writer_rank_and_an_unread_one_is_still_checked(tmp_path):
    state, path, record = _verified_checkpoint(tmp_path)
    names = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata", "rng/rank-1.pt"]
    assert [ShardVerifier(record, names, r, 2).mine for r in (0, 1)] == \
        [["__0_0.distcp", "__2_0.distcp"], ["__1_0.distcp"]]
    assert ShardVerifier(record, sorted(record["files"]), 0, 1).problems(path) == []  # unread
    (path / "__0_0.distcp").unlink()
    verifier = ShardVerifier(record, sorted(record["files"]), rank=0, world=1)
    assert verifier.problems(path) == ["__0_0.distcp: missing"]


def test_four_writer_threads_write_four_checksummed_files_that_load_verified(tmp_path):
    """checkpoint.writer_threads (4 on GPU, issue 25): DCP writes one file per thread,
    __0_0..3.distcp, each checksummed as written, and the verified load reads them all."""
    state = dict({k: v.clone() for k, v in TENSORS.items()},
                 **{f"big{i}": torch.randn(1 << 16) for i in range(4)})
    path = tmp_path / "ckpt"
    writer = ChecksummingWriter(path, thread_count=4)
    dcp.save(state, storage_writer=writer, no_dist=True)
    shards = sorted(n for n in writer.checksums if n.endswith(".distcp"))
    assert shards == [f"__0_{i}.distcp" for i in range(4)]
    assert all(file_checksum(path / n) == (writer.checksums[n]["size"],
                                           writer.checksums[n]["checksum"]) for n in shards)
    record = {"files": store.checksum_files(path, store.step_files(path))}
    verifier = ShardVerifier(record, sorted(record["files"]), rank=0, world=1)
    assert verifier.mine == shards
    loaded = _zeros(state)
    safe_load(loaded, path, verifier=verifier)
    assert verifier.problems(path) == []
    for key in state:
        assert torch.equal(loaded[key], state[key]), key


WRITE_OUT = r"""
import sys, torch
from enn_cluster.storage.dcp_io import ChecksummingWriter
import torch.distributed.checkpoint as dcp
state = {f"w{i}": torch.full((5 << 20,), float(i)) for i in range(5)}  # 5 x 20 MB
dcp.save(state, storage_writer=ChecksummingWriter(sys.argv[1]), no_dist=True)
"""


def test_a_shard_is_written_out_as_it_goes_and_fsynced_whole(tmp_path):
    """A real strace of a 100 MB save: the shard's write-out is requested each time 32 MB
    more were written (sync_file_range), and the closing fsync comes after its last byte
    (DCP fsyncs before it closes the stream: the buffered tail is flushed first)."""
    import re
    import shutil
    import subprocess
    import sys

    if shutil.which("strace") is None:
        pytest.fail("strace is missing: make system-deps installs it")
    trace, out = tmp_path / "trace", tmp_path / "ckpt"
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=openat,write,sync_file_range,fsync",
                    "-o", str(trace), sys.executable, "-c", WRITE_OUT, str(out)], check=True)
    shard = out / "__0_0.distcp"
    fd, events = None, []
    for line in trace.read_text().splitlines():
        if fd is None and str(shard) in line and "openat" in line:
            fd = int(line.rsplit("=", 1)[1])
        elif fd is not None and re.search(rf"\b(write|sync_file_range|fsync)\({fd}\b", line):
            events.append(line)
    ranges = [tuple(int(v) for v in re.search(r"sync_file_range\(\d+, (\d+), (\d+)", e).groups())
              for e in events if "sync_file_range" in e]
    size = shard.stat().st_size
    assert len(ranges) >= 2, events[:5]  # 20 MB tensor records: a request at 40 and 80 MB
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert all(n >= 32 << 20 for _, n in ranges) and size - sum(ranges[-1]) < 32 << 20
    last_write = max(i for i, e in enumerate(events) if e.split("(")[0].endswith("write"))
    fsyncs = [i for i, e in enumerate(events) if "fsync(" in e]
    assert fsyncs and fsyncs[-1] > last_write, events[-3:]
