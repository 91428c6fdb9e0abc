"""DCP `.metadata` through the allow-list: Debian Python 3.11.2's enum form loads (train,
verify, predict), getattr on anything else and any unlisted module are refused, the latter
before the module is imported; verify and predict refuse what the loader would refuse."""
from __future__ import annotations

import enum
import pathlib
import pickle
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, cli, train_tiny


class _Py3112Pickler(pickle.Pickler):
    """Pickles enum members the way CPython 3.11.0-3.11.4 does: getattr(EnumClass, NAME)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _py3112_dumps(obj) -> bytes:
    import io

    buf = io.BytesIO()
    _Py3112Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _globals(data: bytes) -> set[str]:
    """The module.name globals a pickle names, as plain pickle resolves them."""
    import io

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


class _Getattr:
    """Unpickles as getattr(target, name)."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("md"), "md")


def _input(tmp_path: pathlib.Path) -> pathlib.Path:
    import numpy as np

    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32))
    return path


def _rewrite_metadata(step: pathlib.Path, data: bytes) -> None:
    """Replace `.metadata` and its commit record entry, as a writer of that form would."""
    import json

    from enn_cluster.storage import commits as store

    (step / ".metadata").write_bytes(data)
    record = store.read_commit(step)
    record["files"].update(store.checksum_files(step, [".metadata"]))
    (step / "commit.json").write_text(json.dumps(record))


def test_python_3_11_2_enum_form_verifies_and_predicts(trained, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    step = trained / "checkpoints" / "step-2"
    md = FileSystemReader(str(step)).read_metadata()
    data = _py3112_dumps(md)
    assert "builtins.getattr" in _globals(data)
    assert "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING" in _globals(data)
    _rewrite_metadata(step, data)

    verify = cli("verify", trained)
    assert verify.returncode == 0 and "step-2: OK" in verify.stdout, verify.stdout
    pred = cli("predict", trained, "--input", _input(tmp_path), "--procs-per-node", "1")
    assert pred.returncode == 0, pred.stderr
    out = tmp_path / "p.npy"
    assert cli("collect", trained, "--out", out).returncode == 0 and out.exists()


def test_getattr_payload_fails_verify_and_predict_in_one_line(trained, tmp_path):
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "copy"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("predictions"))
    (run / "predictions").mkdir()
    step = run / "checkpoints" / "step-2"
    md = FileSystemReader(str(step)).read_metadata()
    md.planner_data = _Getattr(pathlib.PosixPath, "write_text")
    _rewrite_metadata(step, pickle.dumps(md))

    verify = cli("verify", run)
    assert verify.returncode == 1 and "step-2: CORRUPT: .metadata" in verify.stdout
    assert "getattr(PosixPath, 'write_text')" in verify.stdout
    pred = cli("predict", run, "--input", _input(tmp_path), "--procs-per-node", "1")
    assert pred.returncode == 2, pred.stderr
    assert pred.stderr.strip().count("\n") == 0 and "Traceback" not in pred.stderr
    assert "step-2" in pred.stderr and "enn-submit verify" in pred.stderr
    assert list((run / "predictions").iterdir()) == []


def _load(data: bytes):
    import io

    from enn_cluster.storage.dcp_metadata import MetadataUnpickler

    return MetadataUnpickler(io.BytesIO(data)).load()


def test_enum_members_load_by_name_and_nothing_else_through_getattr():
    import torch
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as ENC

    for member in ENC:
        assert _load(_py3112_dumps(member)) is member
    hostile = [
        _Getattr(pathlib.PosixPath, "write_text"),      # allow-listed class, not an enum
        _Getattr(torch.Size, "__class__"),
        _Getattr(ENC, "__class__"),                     # an enum, not a member name
        _Getattr(ENC, "_member_map_"),
        _Getattr(ENC, "mro"),
        _Getattr(ENC.TORCH_CONTIGUOUS_FORMAT, "name"),  # a member, not the class
        _Getattr(enum.Enum, "__new__"),
        _Getattr(pickle.Pickler, "dump"),               # a module never listed
        _Getattr(set, "add"),
    ]
    for gadget in hostile:
        with pytest.raises(pickle.UnpicklingError):
            _load(pickle.dumps(gadget))


def test_unlisted_modules_refused_before_import(tmp_path):
    """A record that names a module outside the list never imports it: not a torch
    submodule that is imported lazily, not a module on sys.path that acts on import."""
    (tmp_path / "enn_probe_mod.py").write_text(
        f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\nx = 1\n")
    script = textwrap.dedent(f"""
        import pickle, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch
        from enn_cluster.storage.dcp_metadata import MetadataUnpickler, load_metadata
        import io
        for module, name in [("torch.onnx", "export"), ("enn_probe_mod", "x"),
                             ("torch._dynamo", "optimize"), ("torch", "onnx"),
                             ("torch", "_dynamo"), ("torch.distributed.checkpoint.metadata",
                                                    "torch")]:
            data = b"\\x80\\x02c" + f"{{module}}\\n{{name}}\\n".encode() + b"."
            try:
                MetadataUnpickler(io.BytesIO(data)).load()
            except pickle.UnpicklingError as exc:
                assert f"{{module}}.{{name}}" in str(exc), exc
            else:
                raise SystemExit(f"{{module}}.{{name}} was let through")
        for m in ("torch.onnx", "torch._dynamo", "enn_probe_mod"):
            assert m not in sys.modules, m
        print("refused")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr
    assert not (tmp_path / "IMPORTED").exists()


def test_verify_refuses_a_path_that_is_not_a_run(tmp_path):
    proc = cli("verify", tmp_path)
    assert proc.returncode == 2 and "RUN_DIR" in proc.stderr and "Traceback" not in proc.stderr
