"""A weights folder's safetensors headers are checked against the model its config.json
describes before anything is written (issue 38 section 4): a tensor saved transposed, a
tensor missing, a header length past the file or a header that is not JSON is one line,
exit 2, naming the file and the tensor, and no run directory is made. Real tiny models
written by save_pretrained, in fp32 and in bf16 (as users' weights are saved)."""
from __future__ import annotations

import json
import struct

import pytest

from helpers import cli, refused, write_config
from lm_support import PRECISIONS, bf16_training, copy_model, lm_config, tiny_model

TENSOR = "model.embed_tokens.weight"


@pytest.fixture(scope="module", params=PRECISIONS)
def saved(request, tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("headers"), precision=request.param), request.param


def _rewrite(folder, change) -> None:
    """model.safetensors written again by safetensors itself, its tensors changed by `change`."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def _transposed(tensors) -> None:
    tensors[TENSOR] = tensors[TENSOR].t()


def _missing(tensors) -> None:
    del tensors["model.layers.1.mlp.up_proj.weight"]


def _header(folder, length: int, body: bytes) -> None:
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", length) + body)


def _cut_short(file) -> None:
    with open(file, "r+b") as fh:
        fh.truncate(fh.seek(0, 2) - 1000)


def _config(tmp_path, model, precision):
    cfg = lm_config(tmp_path, model, "bad", rows=16, length=16,
                    training={"max_steps": 2, **bf16_training(precision)},
                    parallel={"nodes": 1, "procs_per_node": 1})
    return write_config(tmp_path / "run.yaml", **cfg)


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_a_transposed_tensor_is_refused_by_name_before_any_run(saved, tmp_path, command):
    model, precision = saved
    bad = copy_model(model, tmp_path / "weights")
    _rewrite(bad, _transposed)
    vocab, hidden = json.loads((bad / "config.json").read_text())["vocab_size"], 64
    res = cli(command, "--config", _config(tmp_path, bad, precision), timeout=120)
    refused(res, "model.name", str(bad / "model.safetensors"), TENSOR,
             f"shape [{hidden}, {vocab}]", f"needs [{vocab}, {hidden}]")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("damage,words", [
    ("missing", ("holds tensor model.layers.1.mlp.up_proj.weight",)),
    ("huge-length", ("header length 18446744073709551615",)),
    ("not-json", ("not JSON",)),
    ("no-shape", ("no valid shape",)),
    ("cut-short", ("is cut short", "copy the weights folder again")),
    ("trailing", ("1000 bytes past its last tensor",)),
    ("bytes-off", (f"tensor '{TENSOR}' holds 8 bytes", "needs 16")),
])
def test_a_damaged_header_is_one_line(tmp_path_factory, tmp_path, damage, words):
    """On the users' bf16 model only: the header is refused before its dtype matters."""
    precision = "bf16"
    model = tiny_model(tmp_path_factory.getbasetemp() / "bf16-headers", precision=precision)
    bad = copy_model(model, tmp_path / "weights")
    if damage == "missing":
        _rewrite(bad, _missing)
    elif damage == "huge-length":
        _header(bad, 2**64 - 1, b"{}")
    elif damage == "not-json":
        _header(bad, 6, b"{nope!")
    elif damage == "cut-short":  # a copy that stopped 1000 bytes early
        _cut_short(bad / "model.safetensors")
    elif damage == "trailing":
        with open(bad / "model.safetensors", "ab") as fh:
            fh.write(bytes(1000))
    elif damage == "bytes-off":
        body = json.dumps({TENSOR: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}})
        _header(bad, len(body), body.encode() + bytes(8))
    else:
        body = json.dumps({TENSOR: {"dtype": "F32", "shape": "big", "data_offsets": [0, 0]}})
        _header(bad, len(body), body.encode())
    res = cli("prepare", "--config", _config(tmp_path, bad, precision), timeout=120)
    refused(res, "model.name", *words)
    assert not (tmp_path / "runs").exists()


def test_the_weights_as_saved_still_prepare(saved, tmp_path):
    model, precision = saved
    res = cli("prepare", "--config", _config(tmp_path, model, precision), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


def test_weights_cut_short_after_prepare_are_one_line_from_the_worker(tmp_path_factory, tmp_path):
    """An external launcher starts the workers with no client check in between: the folder
    was cut short after `prepare`, and the worker reads the headers again and says so in one
    line, exit 2, instead of DCP's traceback and exit 1."""
    import os
    import socket
    import subprocess
    import sys

    from helpers import ROOT

    precision = "bf16"
    model = tiny_model(tmp_path_factory.getbasetemp() / "bf16-headers", precision=precision)
    weights = copy_model(model, tmp_path / "weights")
    res = cli("prepare", "--config", _config(tmp_path, weights, precision), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    _cut_short(weights / "model.safetensors")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.worker",
                          str(tmp_path / "runs" / "bad"), "--task", "train"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "model.name:" in last and f"{weights}/model.safetensors is cut short" in last, last
