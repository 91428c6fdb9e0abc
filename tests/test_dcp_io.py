"""DCP storage plumbing: the header-only layout parser, in-place reads, checksumming writes."""
from __future__ import annotations

import io
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from enn_cluster.storage import torch_save_layout as tsl
from enn_cluster.storage.checksum import file_checksum
from enn_cluster.storage.dcp_io import ChecksummingWriter, safe_load

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
