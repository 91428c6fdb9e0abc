"""Where a one-tensor `torch.save` record keeps its bytes, read from the record's first KiB.

DCP stores each tensor as a small zip written by torch.save: `data.pkl` (the tensor's
dtype, shape, strides), three tiny records, `byteorder`, then the raw bytes in
`data/0`, followed by more records and the zip directory at the end. torch.load needs
that end-of-record directory: for a cold checkpoint that is a backward seek per tensor,
which halves read throughput here. The local headers at the front say the same, so
this parses them (pure: bytes in, layout out). Anything unexpected returns None and the
caller takes torch's own path; `descriptor_ok` checks the zip data descriptor that
follows the tensor bytes, so a wrong offset cannot go unnoticed.
"""
from __future__ import annotations

import functools
import io
import pickle
import struct
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_SIG, _DESC_SIG = b"PK\x03\x04", b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08
DESCRIPTOR_MAX = 24  # signature, crc32, then 4- or 8-byte (zip64) sizes


@dataclass(frozen=True)
class TensorLayout:
    saved: torch.Tensor  # a meta tensor: dtype, shape, strides, storage offset as saved
    data_start: int  # where data/0 (the storage bytes) begins, from the record's start
    nbytes: int  # the storage's size in bytes
    little_endian: bool


def _local_header(head: bytes, pos: int) -> tuple[str, int, int, int]:
    """(name, data start, flags, compression method) of the zip local header at `pos`."""
    sig, _, flags, method, _, _, _, _, _, nlen, elen = _LOCAL.unpack_from(head, pos)
    if sig != _LOCAL_SIG:
        raise ValueError(f"no local header at {pos}")
    name = head[pos + _LOCAL.size:pos + _LOCAL.size + nlen].decode("utf-8", "replace")
    return name, pos + _LOCAL.size + nlen + elen, flags, method


def _descriptor_end(head: bytes, start: int, data_end: int) -> Optional[int]:
    """Where the next local header starts after a small record's descriptor (which must
    record the record's size)."""
    if not descriptor_ok(head[data_end:data_end + 16], data_end - start):
        return None
    return data_end + 16  # small records: 32-bit sizes


class _Storage(tuple):
    """(dtype, numel) of the one storage a tensor record refers to."""


def _rebuild(storage, offset, size, stride, *_):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


@functools.lru_cache(maxsize=None)
def _storage_dtypes() -> dict:
    """'FloatStorage' -> torch.float32, ...: the legacy storage class names torch.save
    pickles, read from torch's public classes (each still carries its dtype)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "TypedStorage is deprecated"
        for name in (n for n in dir(torch) if n.endswith("Storage")):
            dtype = getattr(getattr(torch, name), "dtype", None)
            if isinstance(dtype, torch.dtype):
                out[name] = dtype
    return out


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a tensor record's data.pkl into plain tuples: the globals it names resolve
    to stand-ins, so unpickling runs nothing from the file (and is fast: C pickle)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor record")

    def persistent_load(self, saved_id):
        kind, dtype, key, _, numel = saved_id
        if kind != "storage" or str(key) != "0" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("not a one-storage tensor record")
        return _Storage((dtype, int(numel)))


def _meta_tensor(pkl: io.BytesIO) -> Optional[torch.Tensor]:
    """A meta tensor with the saved dtype, shape, strides and storage offset."""
    out = _LayoutUnpickler(pkl).load()
    if not (isinstance(out, tuple) and len(out) == 5 and out[0] == "tensor"
            and isinstance(out[1], _Storage)):
        return None
    _, (dtype, numel), offset, size, stride = out
    storage = torch.empty(numel, dtype=dtype, device="meta")
    return storage.as_strided(size, stride, offset)


def parse(head: bytes) -> Optional[TensorLayout]:
    """The layout of a one-tensor torch.save record from its first bytes, or None."""
    try:
        return _parse(head)
    except Exception:  # a malformed header or pickle, whatever the unpickler raises
        return None


def _parse(head: bytes) -> Optional[TensorLayout]:
    pos, saved, little = 0, None, None
    while pos is not None:
        name, start, flags, method = _local_header(head, pos)
        if method != 0 or not flags & _HAS_DESCRIPTOR:
            return None  # compressed, or sizes elsewhere: not what torch.save writes today
        if name.endswith("/data/0"):
            if saved is None or little is None:
                return None
            return TensorLayout(saved, start, saved.untyped_storage().nbytes(), little)
        if name.endswith("/data.pkl"):
            pkl = io.BytesIO(head[start:])
            saved = _meta_tensor(pkl)
            if saved is None:
                return None
            data_end = start + pkl.tell()
        else:  # a small text record: .format_version, .storage_alignment, byteorder
            data_end = head.find(_DESC_SIG, start)
            if name.endswith("/byteorder"):
                little = head[start:data_end] == b"little"
        pos = _descriptor_end(head, start, data_end) if data_end >= 0 else None
    return None


def descriptor_ok(desc: bytes, nbytes: int) -> bool:
    """The zip data descriptor right after the tensor bytes records exactly `nbytes`."""
    if desc[:4] != _DESC_SIG:
        return False
    small = len(desc) >= 16 and struct.unpack_from("<II", desc, 8) == (nbytes, nbytes)
    large = len(desc) >= 24 and struct.unpack_from("<QQ", desc, 8) == (nbytes, nbytes)
    return small or large
