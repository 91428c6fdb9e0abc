"""Input data sources, judged before anything is written: where a source is and how to open it.

`prepare` and `predict --input` check every source (exists, no credentials in the URL, a
.npy/.npz whose header matches its size, inputs and targets with the same rows) before the
run directory exists, so a bad path fails in one line and leaves nothing behind; staging
opens sources through the same functions, so the check and the copy read the same bytes.
"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

from enn_cluster.config.run_config import DataConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.npy_header import check_layout, read_header


# ---------------------------------------------------------------------------------------
# Opening a source: a local file without fsspec, anything else through it


def local_path(source: str) -> Optional[str]:
    """The file behind a plain path or file:// URL; None for other fsspec URLs."""
    if "://" not in source and "::" not in source:  # a plain path: no fsspec import
        return os.path.expanduser(source)
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(source)
    return path if isinstance(fs, LocalFileSystem) else None


def open_npy_stream(source: str, key: Optional[str], field: str = "data.x_key/y_key"):
    """A readable stream of the .npy (or of member `key` of the .npz), what to close, and
    the stream's size in bytes where known (None otherwise)."""
    import fsspec

    handle = fsspec.open(source, "rb").open()
    if key is None:
        return handle, [handle], getattr(handle, "size", None)
    try:
        zf = zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        handle.close()
        raise UserError.on(field, f"{source} is not a readable .npz file; save it with "
                                  "np.savez") from None
    name = key if key.endswith(".npy") else key + ".npy"
    if name not in zf.namelist():
        held = ", ".join(repr(n[:-4]) for n in zf.namelist()[:20] if n.endswith(".npy"))
        zf.close()
        handle.close()
        raise UserError.on(field, f"{source} has no array {key!r} (data.x_key/y_key); "
                                  f"it holds {held or 'none'}")
    member = zf.open(name)
    return member, [member, zf, handle], zf.getinfo(name).file_size


# ---------------------------------------------------------------------------------------
# Source description (pure) and existence checks before anything is written


def check_source(field: str, path: Optional[str]) -> None:
    """Fail before the run directory exists when an input file is missing or unusable."""
    if path is None or path == "synthetic":
        return
    from enn_cluster.config.checks import check_regular_file, no_credentials_in_url

    no_credentials_in_url(field, path)
    if not (path.endswith(".npy") or path.endswith(".npz")):
        raise UserError.on(field, f"{path!r} must be a .npy or .npz file (local path or "
                                  "fsspec URL)")
    fix = "fix the path or use 'synthetic'" if field == "data.train_path" else "fix the path"
    if "://" not in path and "::" not in path:  # a plain path: no fsspec import
        check_regular_file(field, os.path.expanduser(path), fix)
        return
    import fsspec

    try:
        fs, _, paths = fsspec.get_fs_token_paths(path)
        exists = fs.exists(paths[0])
    except (ValueError, ImportError, OSError) as exc:
        raise UserError.on(field, f"cannot open {path!r} ({exc}); check the URL and its "
                                  "fsspec extra")
    if not exists:
        raise UserError.on(field, f"{path} does not exist; {fix}")


def check_data_sources(data: DataConfig) -> None:
    """Every input file exists and holds an array we can stage, and inputs and targets have
    the same rows: checked from the headers, before the run directory exists."""
    if data.train_path.endswith(".npy") and not data.train_targets_path:
        raise UserError("data.train_targets_path: required when data.train_path is a .npy "
                        "(or give an .npz holding data.x_key and data.y_key)")
    for x_field, y_field in (("data.train_path", "data.train_targets_path"),
                             ("data.eval_path", "data.eval_targets_path")):
        x_path, y_path = getattr(data, x_field[5:]), getattr(data, y_field[5:])
        check_source(x_field, x_path)
        check_source(y_field, y_path)
        if x_path is None or x_path == "synthetic":
            continue
        x_rows = inspect_array(x_field, x_path, data.x_key if x_path.endswith(".npz") else None)
        y_src = y_path or x_path
        y_rows = inspect_array(y_field if y_path else x_field, y_src,
                               data.y_key if y_src.endswith(".npz") else None)
        if x_rows != y_rows:
            raise UserError(f"{x_field}: {x_path} has {x_rows} rows but its targets "
                            f"({y_field if y_path else data.y_key}) have {y_rows}; they must match")


def inspect_array(field: str, source: str, key: Optional[str] = None) -> int:
    """Open `source` (a .npy, or array `key` of an .npz; a path or fsspec URL), check its
    header against its size, and return its rows. Nothing of the data is read."""
    return _inspect(field, source, key)[1]


def array_shape(field: str, source: str, key: Optional[str] = None) -> tuple:
    """The shape in `source`'s header, checked as `inspect_array` checks it."""
    return tuple(_inspect(field, source, key)[0])


def _inspect(field: str, source: str, key: Optional[str]) -> tuple:
    local = local_path(source) if key is None else None
    try:
        if local is not None:
            with open(local, "rb") as fh:
                shape, fortran, dtype = read_header(fh, field, source)
                return shape, check_layout(field, source, shape, fortran, dtype,
                                           os.fstat(fh.fileno()).st_size - fh.tell())
        stream, closers, size = open_npy_stream(source, key, field)
        try:
            shape, fortran, dtype = read_header(stream, field, source)
            return shape, check_layout(field, source, shape, fortran, dtype,
                                       None if size is None else size - stream.tell())
        finally:
            for c in closers:
                c.close()
    except OSError as exc:
        raise UserError.on(field, f"cannot read {source} ({exc.strerror or exc}); "
                                  "check the path and its permissions") from None
