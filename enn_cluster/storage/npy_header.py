"""Judging a .npy by its header alone: which arrays we stage (numeric, C-ordered, with rows)
and whether the file holds the bytes its header promises. Staging, collect, predict and
doctor read headers through here; nothing of the data is read."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from enn_cluster.errors import UserError


def read_npy_header(fh) -> tuple[tuple, bool, np.dtype]:
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fh)
    return np.lib.format.read_array_header_2_0(fh)


# Dtype kinds we stage: booleans, integers, floats. Complex would lose its imaginary part in
# a float model; objects need pickle; strings are not features.
NUMERIC_KINDS = "biuf"


def check_layout(field: str, source: str, shape, fortran: bool, dtype, data_bytes: Optional[int]) -> int:
    """The header of an input array, judged without reading its data: rows returned. Pure.
    `data_bytes`: what the file holds after the header, where known."""
    if not isinstance(shape, tuple) or not shape:
        raise UserError.on(field, f"{source} holds a single value, not rows of features; "
                                  "save a 2-D array (rows x features)")
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise UserError.on(field, f"{source} has an invalid shape in its header; re-save it "
                                  "with np.save")
    if shape[0] == 0:
        raise UserError.on(field, f"{source} has no rows; give a file with data")
    if 0 in shape[1:]:
        raise UserError.on(field, f"{source} has shape {shape}: a row with no values; give "
                                  "at least one feature per row")
    if dtype.kind not in NUMERIC_KINDS:
        what = {"c": "complex (its imaginary part would be lost)", "O": "Python objects",
                "U": "strings", "S": "bytes", "V": "records"}.get(dtype.kind, str(dtype))
        raise UserError.on(field, f"{source} holds {what}; convert it to a float or integer "
                                  "array (e.g. x.astype('float32')) and save it again")
    if fortran:
        raise UserError.on(field, f"{source} is Fortran-ordered; save it with "
                                  "np.save(path, np.ascontiguousarray(x))")
    need = math.prod(shape) * dtype.itemsize
    if data_bytes is not None and data_bytes != need:
        raise UserError.on(field, f"{source} is truncated or damaged (its header promises {need} "
                                  f"bytes of data, the file holds {data_bytes}); save it again")
    return shape[0]


def read_header(fh, field: str, source: str):
    """The header of an open .npy; anything unreadable is one line naming `field`."""
    try:
        return read_npy_header(fh)
    except (ValueError, TypeError, SyntaxError, EOFError, OSError):
        raise UserError.on(field, f"{source} is not a readable .npy file (bad or truncated "
                                  "header); save it with np.save") from None
