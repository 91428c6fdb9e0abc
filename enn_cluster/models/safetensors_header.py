"""A weights folder's safetensors files judged by their headers alone (8 bytes of header
length, little-endian, then that much JSON naming each tensor's dtype, shape and offsets).

The folder is user input: a header length past the file or past safetensors' own limit, a
header that is not JSON, an entry that is not a tensor, or one whose bytes lie past the end
of the file (a copy cut short) is one line naming the file; no tensor data is read.
`tensors` is what `model.name`'s check compares with the model its config.json describes,
so a tensor of the wrong shape is refused at `prepare`, by name, instead of as a multi-line
size mismatch on every rank. `encode_header` is the writing side, for a file whose tensors
are written one at a time after it (`export --format hf`).
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

from enn_cluster.errors import UserError

HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header (its MAX_HEADER_SIZE)
# torch dtype name -> safetensors' dtype code
CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
         "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
         "bool": "BOOL"}
# safetensors' dtype code -> bytes per element (codes not listed: size not checked)
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def encode_header(entries: list[tuple[str, str, tuple, int]]) -> bytes:
    """The header (length + JSON) of a safetensors file whose tensors, given as (name,
    torch dtype name, shape, bytes), follow it back to back in this order: what lets a
    writer stream them without holding the file. Padded to 8 bytes, as safetensors does."""
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                        "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(path: Path, field: str = "model.name") -> dict:
    """{tensor name: its header entry} of one safetensors file (`__metadata__` left out)."""
    fix = "restore the file save_pretrained wrote"
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            head = fh.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > min(HEADER_LIMIT, size - 8):
                raise UserError(f"{field}: {path} is not a safetensors file (its header length "
                                f"{length} does not fit a file of {size} bytes); {fix}")
            header = json.loads(fh.read(length))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        raise UserError(f"{field}: {path} has a safetensors header that is not JSON; "
                        f"{fix}") from None
    except OSError as exc:
        raise UserError(f"{field}: {path} cannot be read ({exc.strerror or exc}); {fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{field}: {path} has a safetensors header that is not a mapping; {fix}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - length
    for name, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise UserError(f"{field}: {path}: tensor {name[:200]!r} has no valid shape in its "
                            f"header; {fix}")
        _check_extent(path, name, entry, field)
    end = max((e["data_offsets"][1] for e in tensors.values()), default=0)
    if end > data:
        raise UserError(f"{field}: {path} is cut short: its header places tensor data up to "
                        f"byte {8 + length + end}, but the file has {size} bytes (a copy that "
                        "stopped?); copy the weights folder again")
    if end < data:  # safetensors itself refuses a file its tensors do not cover
        raise UserError(f"{field}: {path} has {data - end} bytes past its last tensor, which "
                        f"safetensors refuses; {fix}")
    return tensors


def _check_extent(path: Path, name: str, entry: dict, field: str) -> None:
    """The tensor's offsets are as many bytes as its shape and dtype need (read_header then
    checks they lie inside the file: a file cut short is refused there, not as a DCP error
    on every rank)."""
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        raise UserError(f"{field}: {path}: tensor {name[:200]!r} has no valid data_offsets in "
                        "its header; restore the file save_pretrained wrote")
    item = ITEM_BYTES.get(entry.get("dtype"))
    need = item * math.prod(entry["shape"]) if item else None
    if need is not None and offsets[1] - offsets[0] != need:
        raise UserError(f"{field}: {path}: tensor {name[:200]!r} holds "
                        f"{offsets[1] - offsets[0]} bytes, but its shape {entry['shape']} of "
                        f"{entry['dtype']} needs {need}; restore the file save_pretrained wrote")


class FolderTensor(NamedTuple):
    """One tensor of a weights folder, as its file's header gives it."""
    shape: tuple
    file: Path
    dtype: str  # safetensors' code (BF16, F32, ...)


def tensors(folder: Path, field: str = "model.name") -> dict[str, FolderTensor]:
    """{tensor name: FolderTensor} over every *.safetensors file in `folder`."""
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, entry in read_header(file, field).items():
            out[name] = FolderTensor(tuple(entry["shape"]), file, entry.get("dtype"))
    return out


def check_shapes(folder: Path, expected: dict[str, tuple], field: str = "model.name",
                 found: dict | None = None) -> None:
    """Every tensor the model needs (`expected`: name -> shape) is in a file of `folder`,
    with that shape; tensors the model does not use are left alone. `found`: its `tensors`,
    when already read."""
    found = tensors(folder, field) if found is None else found
    for name, want in expected.items():
        if name not in found:
            raise UserError(f"{field}: no safetensors file in {folder} holds tensor {name}, "
                            "which the model its config.json describes needs; restore the "
                            "files save_pretrained wrote")
        shape, file, _ = found[name]
        if shape != tuple(want):
            raise UserError(f"{field}: {file}: tensor {name} has shape {list(shape)}, but the "
                            f"model its config.json describes needs {list(want)}; restore "
                            "the weights save_pretrained wrote for this config.json")
