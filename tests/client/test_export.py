"""`enn-submit export`: a DCP checkpoint of a real 2-rank run becomes model.pt (full state
dict) and model.pt2 (torch.export program); the program's forward equals what `predict`
+ `collect` give for the same rows. Tolerance 1e-5 absolute (same fp32 math, other batch
boundaries). A model that branches on a tensor's value is refused with one line naming
the offending code; bad input exits 2 and leaves nothing."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import ROOT, cli, full_params, small_config, write_config

import enn_cluster

ATOL = 1e-5
TESTS = ROOT / "tests"  # as cwd: `python -m` puts it on sys.path, workers inherit it


def _train(tmp, name, **over):
    cfg = small_config(tmp, name, data={"normalize_targets": True},
                       training={"max_steps": 3}, checkpoint={"every_steps": 3},
                       parallel={"nodes": 1, "procs_per_node": 2}, **over)
    done = cli("train", "--config", write_config(tmp / f"{name}.yaml", **cfg), cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs" / name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("export"), "e")


def test_exported_program_forward_equals_predict(trained, tmp_path):
    x = np.random.default_rng(3).standard_normal((37, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = cli("predict", trained, "--input", tmp_path / "x.npy", "--name", "ex",
               "--chunk-rows", "16", "--batch-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    for raw, out in ((True, "raw.npy"), (False, "y.npy")):
        got = cli("collect", trained, "--name", "ex", "--out", tmp_path / out,
                  *(["--raw"] if raw else []))
        assert got.returncode == 0, got.stderr
    art = tmp_path / "artifact"
    done = cli("export", trained, "--out", art, "--format", "export")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(art)
    assert sorted(p.name for p in art.iterdir()) == ["export.json", "model.pt", "model.pt2"]
    assert not list(tmp_path.glob(".artifact.tmp-*"))
    record = json.loads((art / "export.json").read_text())
    assert record["step"] == 3 and record["input_shape"] == [8] and record["format"] == "export"
    program = torch.export.load(str(art / "model.pt2")).module()
    with torch.no_grad():
        y = program(torch.from_numpy(x)).numpy()
        one = program(torch.from_numpy(x[:1])).numpy()  # the batch dimension is dynamic
    np.testing.assert_allclose(y, np.load(tmp_path / "raw.npy"), atol=ATOL, rtol=0)
    np.testing.assert_allclose(one, y[:1], atol=ATOL, rtol=0)
    scaler = record["target_scaler"]
    denorm = y * np.asarray(scaler["std"], np.float32) + np.asarray(scaler["mean"], np.float32)
    np.testing.assert_allclose(denorm, np.load(tmp_path / "y.npy"), atol=1e-4, rtol=0)
    state = torch.load(art / "model.pt", weights_only=True)
    dcp = full_params(trained / "checkpoints" / "step-3")
    assert sorted(state) == sorted(dcp)
    for key in dcp:
        assert torch.equal(state[key], dcp[key]), key
    # the Python API writes the same state dict
    api = enn_cluster.export(trained, tmp_path / "api-art")
    assert sorted(p.name for p in api.iterdir()) == ["export.json", "model.pt"]
    for key, value in torch.load(api / "model.pt", weights_only=True).items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("args, needle", [
    (["--step", "2"], "--step: step-2 is not a complete checkpoint"),
    (["--format", "onnx"], "--format"),
    (["--out", "EXISTING"], "exists; give a new directory"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained, tmp_path, args, needle):
    (tmp_path / "EXISTING").mkdir()
    out = ["--out", tmp_path / "new"] if "--out" not in args else []
    args = [tmp_path / a if a == "EXISTING" else a for a in args]
    done = cli("export", trained, *out, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["EXISTING"]


def test_corrupt_checkpoint_is_refused(tmp_path):
    run = _train(tmp_path, "c")
    victim = next((run / "checkpoints" / "step-3").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    done = cli("export", run, "--out", tmp_path / "art")
    assert done.returncode == 2 and "step-3 fails verification" in done.stderr, done.stderr
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def test_model_that_is_not_export_safe_names_the_offending_code(tmp_path):
    run = _train(tmp_path, "b", model={"name": "api_models:branchy"})
    done = cli("export", run, "--out", tmp_path / "art", "--format", "export",
               cwd=TESTS)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "api_models:branchy is not export-safe" in line
    assert "data-dependent" in line and "api_models.py" in line
    assert "`if x.mean() > 100.0:" in line and "--format torch" in line
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))
    # the weights alone still export
    done = cli("export", run, "--out", tmp_path / "art", cwd=TESTS)
    assert done.returncode == 0, done.stderr
