"""model.pkl is a run file, so untrusted: it is read only through its commit record and an
allow-list of what a pickled module holds; a pickle naming anything else never runs."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from enn_cluster.errors import UserError
from enn_cluster.storage.model_structure import (
    read_structure,
    record_path,
    structure_bytes,
    write_structure,
)


class _Payload:
    """Pickles as os.system(cmd): what a tampered model.pkl would hold."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.GELU(approximate="tanh"))


def test_a_pickled_module_comes_back_through_the_allow_list(tmp_path):
    model = _model()
    model.register_buffer("scale", torch.arange(3.0), persistent=False)
    write_structure(tmp_path / "model.pkl", structure_bytes(model))
    back = read_structure(tmp_path / "model.pkl")
    assert [type(m) for m in back.modules()] == [type(m) for m in model.modules()]
    assert all(t.is_meta for t in back.state_dict().values())
    assert torch.equal(back.scale, model.scale)  # a whole tensor, through weights-only load
    whole = tmp_path / "whole.pkl"
    write_structure(whole, pickle.dumps(model))  # a run made before structures shipped
    assert torch.equal(read_structure(whole)[0].weight, model[0].weight)


@pytest.mark.parametrize("where", ["top", "inside"])
def test_a_pickle_that_would_run_a_command_is_refused_without_running_it(tmp_path, where):
    marker = tmp_path / "MARKER"
    payload = _Payload(f"touch {marker}")
    obj = payload if where == "top" else {"model": _model(), "hook": payload}
    write_structure(tmp_path / "model.pkl", pickle.dumps(obj))  # the record matches too
    with pytest.raises(UserError) as err:
        read_structure(tmp_path / "model.pkl")
    assert str(err.value).startswith("model.kwargs.path: ") and "\n" not in str(err.value)
    assert "posix.system" in str(err.value)
    assert not marker.exists()


def test_a_global_is_refused_before_its_module_is_imported(tmp_path):
    """The standard library's import-time side effects (antigravity opens a browser) are
    never run: the name is refused from its text."""
    data = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x0bantigravity\x8c\x03geo\x93."
    write_structure(tmp_path / "model.pkl", data)
    with pytest.raises(UserError, match="antigravity.geo"):
        read_structure(tmp_path / "model.pkl")


def test_a_pickle_without_its_record_or_changed_after_it_is_refused(tmp_path):
    path = tmp_path / "model.pkl"
    path.write_bytes(structure_bytes(_model()))
    with pytest.raises(UserError, match="no commit record"):
        read_structure(path)
    write_structure(path, structure_bytes(_model()))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(UserError, match="does not match its commit record"):
        read_structure(path)
    record_path(path).write_text('{"files": []}')
    with pytest.raises(UserError, match="not a commit record"):
        read_structure(path)


def test_a_fifo_in_place_of_the_pickle_is_refused_without_blocking(tmp_path):
    path = tmp_path / "model.pkl"
    write_structure(path, structure_bytes(_model()))
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(UserError, match="a FIFO"):
        read_structure(path)



def test_a_truncated_or_foreign_pickle_is_one_line(tmp_path):
    write_structure(tmp_path / "model.pkl", structure_bytes(_model())[:-10])
    with pytest.raises(UserError, match=r"does not unpickle \((EOFError|UnpicklingError)"):
        read_structure(tmp_path / "model.pkl")
    write_structure(tmp_path / "model.pkl", pickle.dumps({"a": (1, 2.0)}))
    with pytest.raises(UserError, match="holds a dict, not an nn.Module"):
        read_structure(tmp_path / "model.pkl")
