"""Reading a DCP `.metadata` file through an allow-list: what loading and `verify` share.

DCP's FileSystemReader reads `.metadata` with plain pickle.load: whoever can write a
checkpoint directory could run code in every process that loads it. Ours resolves only
the globals a DCP metadata pickle holds, decided from the names alone, so a record that
names any other module is refused before that module is imported. Python 3.11.0-3.11.4
(Debian 12's 3.11.2) pickle enum members as `getattr(EnumClass, 'MEMBER')`: that one form is
allowed, for enums of DCP's metadata module and their member names only.
No torch import at module level: `enn-submit verify` imports torch only when it reads one.
"""
from __future__ import annotations

import enum
import importlib
import pickle
from pathlib import Path
from typing import Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch.serialization", "_get_layout"), ("torch", "Size"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("builtins", "slice")}
_MODULES = {m for m, _ in _GLOBALS} | {METADATA_MODULE}


def _refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"checkpoint metadata refers to {what}, which a DCP "
                                  "checkpoint never holds; refusing to load it")


def _metadata_enum_member(cls, name):
    """`getattr` as Python 3.11.2 pickles an enum member: a DCP metadata enum, a member name."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) \
            and cls.__module__ == METADATA_MODULE and isinstance(name, str) \
            and name in cls.__members__:
        return cls[name]
    raise _refuse(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


def torch_value(name: str):
    """A dtype, layout or memory format of the torch namespace (read from its dict, so a
    lazily imported submodule is never loaded by asking)."""
    import torch

    obj = vars(torch).get(name)
    return obj if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None


class MetadataUnpickler(pickle.Unpickler):
    """Only what a DCP `.metadata` holds: its dataclasses and enums, dtypes, layouts, Size,
    paths. Every check runs before the named module is imported."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _metadata_enum_member
        if module == "torch" and name != "Size":
            obj = torch_value(name)
            if obj is not None:
                return obj
        elif module in _MODULES and ((module, name) in _GLOBALS or module == METADATA_MODULE):
            obj = vars(importlib.import_module(module)).get(name)
            if module != METADATA_MODULE or (isinstance(obj, type)
                                             and obj.__module__ == METADATA_MODULE):
                return obj
        raise _refuse(f"{module}.{name}")


def load_metadata(path: Path):
    """The DCP Metadata object of a `.metadata` file, through the allow-list."""
    from enn_cluster.storage.run_files import open_run_file

    with open_run_file(path) as fh:
        metadata = MetadataUnpickler(fh).load()
    kind = type(metadata)
    if (kind.__module__, kind.__name__) != (METADATA_MODULE, "Metadata"):
        raise pickle.UnpicklingError(f"{path} holds a {kind.__name__}, not DCP metadata")
    return metadata


def metadata_problem(step_path: Path) -> Optional[str]:
    """Why this checkpoint's `.metadata` cannot be loaded, or None when it can."""
    try:
        load_metadata(Path(step_path) / ".metadata")
    except UserError as exc:  # not a regular file
        return str(exc)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, OSError, RecursionError) as exc:
        return f".metadata: {exc}"
    return None


def _described(step_path: Path) -> dict:
    """{entry name: its DCP metadata}; UserError naming the step when it cannot be read."""
    problem = metadata_problem(step_path)
    if problem is not None:
        raise UserError("{name}: {problem}", name=Path(step_path).name, problem=problem,
                        fix="this checkpoint cannot be read (verify it with enn-submit verify, "
                            "or give another {step})", step=INPUTS["step"])
    return load_metadata(Path(step_path) / ".metadata").state_dict_metadata


def tensor_names(step_path: Path, prefix: str = "") -> set:
    """The names (less `prefix`) of the entries this checkpoint's `.metadata` describes,
    read through the allow-list; UserError naming the step when it cannot be read."""
    return {k.removeprefix(prefix) for k in _described(step_path) if k.startswith(prefix)}


def tensor_specs(step_path: Path, prefix: str = "") -> dict:
    """{name less `prefix`: (shape, dtype)} of the tensors under `prefix` (what a reader
    allocates to load some of them, before reading any)."""
    return {k.removeprefix(prefix): (tuple(m.size), m.properties.dtype)
            for k, m in _described(step_path).items()
            if k.startswith(prefix) and hasattr(m, "properties")}
