"""Prediction end to end: real workers write chunks, `collect` verifies and assembles.

Reference: a single-process forward pass of the same checkpoint (full weights read back
with DCP in this process). Tolerance: 1e-5 absolute; the workers run the same fp32
module, only batch boundaries may differ.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import enn_cluster
from enn_cluster.storage import prediction_manifest as pm
from helpers import cli, outside_layout, small_config, write_config

ATOL = 1e-5
TRIALS = int(os.environ.get("ENN_FAULT_TRIALS", "1"))
CHUNK = ["--chunk-rows", "40", "--batch-size", "16"]


def _reference(run_dir: Path, x: np.ndarray, step: int, raw: bool = False) -> np.ndarray:
    """`Run.load_model`'s forward: in the targets' units unless `raw`, as predict's are."""
    model = enn_cluster.Run.open(run_dir).load_model(step, raw=raw)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def test_load_model_gives_target_units_unless_raw(trained):
    """With data.normalize_targets, load_model() is de-normalised by default (by the
    manifest's scaler, in float32 like collect) and raw=True is what the model trained on;
    the model object stays the run's own class and state dict."""
    run, _, x, step = trained
    raw, default = _reference(run, x, step, raw=True), _reference(run, x, step)
    scaler = json.loads((run / "data" / "manifest.json").read_text())["target_scaler"]
    expect = raw * np.asarray(scaler["std"], np.float32) + np.asarray(scaler["mean"], np.float32)
    np.testing.assert_allclose(default, expect, atol=1e-6, rtol=0)
    assert not np.allclose(default, raw, atol=1e-3)
    model = enn_cluster.Run.open(run).load_model(step)
    assert sorted(model.state_dict()) == sorted(
        enn_cluster.Run.open(run).load_model(step, raw=True).state_dict())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2x2 HSDP run with normalised targets, and an input of 300 rows (8 chunks)."""
    tmp = tmp_path_factory.mktemp("pred")
    cfg = small_config(tmp, "p", data={"normalize_targets": True},
                       training={"epochs": 1}, checkpoint={"every_steps": 0})
    done = cli("train", "--config", write_config(tmp / "c.yaml", **cfg))
    assert done.returncode == 0, done.stderr[-3000:]
    x = np.random.default_rng(5).standard_normal((300, 8)).astype(np.float32)
    np.save(tmp / "x.npy", x)
    run = tmp / "runs" / "p"
    step = enn_cluster.Run.open(run).latest_checkpoint
    return run, tmp / "x.npy", x, step


def test_predict_2x2_equals_single_process_forward(trained, tmp_path):
    run, xpath, x, step = trained
    done = cli("predict", run, "--input", xpath, "--name", "full", *CHUNK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "full"
    manifest = json.loads((run / "predictions" / "full" / "manifest.json").read_text())
    assert manifest["collapse"] is None and manifest["input_spread"] > 0  # varied: no verdict
    assert manifest["step"] == step and manifest["world_size"] == 4
    assert sorted({c["rank"] for c in manifest["chunks"]}) == [0, 1, 2, 3]
    assert manifest["precision_check"] == {"reduced_precision": False, "dtype": "float32"}
    logs = max((d for d in (run / "logs").iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    said = {r: (logs / f"rank-{r}.log").read_text() for r in range(4)}
    # 2 nodes x 2 ranks: the first rank of each node reads the weights, the other gets them
    assert all(f"weights of step-{step}: read from the checkpoint for this node" in said[r]
               for r in (0, 2)), said
    assert "received from rank 0 on this node" in said[1] and \
        "received from rank 2 on this node" in said[3], said
    assert outside_layout(run) == []  # every file a train and a predict wrote is listed
    got = cli("collect", run, "--name", "full", "--out", tmp_path / "y.npy")
    assert got.returncode == 0, got.stderr
    assert "warning" not in got.stderr  # a trained model's outputs vary across samples
    assert f"collected full (step-{step}): 300 rows of shape (1,)" in got.stderr
    y = np.load(tmp_path / "y.npy")
    assert y.shape == (300, 1)
    np.testing.assert_allclose(y, _reference(run, x, step), atol=ATOL, rtol=0)
    assert cli("collect", run, "--name", "full", "--raw", "--out", tmp_path / "raw.npy").returncode == 0
    np.testing.assert_allclose(np.load(tmp_path / "raw.npy"), _reference(run, x, step, raw=True),
                               atol=ATOL, rtol=0)
    stats = manifest["stats"]  # recorded per output, on the de-normalised values
    assert stats["count"] == 300 and stats["nonfinite"] == [0]
    assert abs(stats["mean"][0] - float(y.mean())) < 1e-4
    assert abs(stats["std"][0] - float(y.std())) < 1e-4
    # the Python API: the same array through the same workers and collection
    api = enn_cluster.predict(run, x, chunk_rows=40, batch_size=16)
    np.testing.assert_array_equal(api, y)


def test_predict_world_1_equals_single_process_forward(trained, tmp_path):
    """One rank reads the checkpoint alone (no node group) into its own replica."""
    run, xpath, x, step = trained
    done = cli("predict", run, "--input", xpath, "--name", "one", "--nodes", "1",
               "--procs-per-node", "1", *CHUNK)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((run / "predictions" / "one" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["precision_check"]["dtype"] == "float32"
    assert cli("collect", run, "--name", "one", "--out", tmp_path / "y.npy").returncode == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), _reference(run, x, step),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_stopped_prediction_continues_with_every_row_once(trained, tmp_path, trial):
    """A random rank dies hard after a random number of its chunks (15 chunks of 20 rows,
    3-4 per rank); the job ends, and a second run at another world size finishes it."""
    run, xpath, x, step = trained
    rnd = random.Random(trial)
    name, rank, after = f"stopped-{trial}", rnd.randrange(4), rnd.randrange(1, 3)
    first = cli("predict", run, "--input", xpath, "--name", name, "--chunk-rows", "20",
                "--batch-size", "8", "--max-restarts", "0",
                env={"ENN_FAULT_PREDICT_EXIT_AFTER_CHUNKS": str(after),
                     "ENN_FAULT_PREDICT_RANK": str(rank)})
    assert first.returncode != 0
    pdir = run / "predictions" / name
    assert (run / "faults" / f"predict-{name}-fired").exists()
    committed = {p.name: p.stat().st_ino for p in pdir.glob("chunk-*.npy")}
    assert after <= len(committed) < 15 and not (pdir / "manifest.json").exists()
    early = cli("collect", run, "--name", name, "--out", tmp_path / "early.npy")
    assert early.returncode == 2 and "not complete" in early.stderr
    assert len(early.stderr.strip().splitlines()) == 1 and not (tmp_path / "early.npy").exists()
    # continue at another world size (3 ranks): the plan of chunks is the same
    again = cli("predict", run, "--name", name, "--nodes", "1", "--procs-per-node", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    manifest = json.loads((pdir / "manifest.json").read_text())
    assert manifest["world_size"] == 3
    assert pm.coverage_problems(manifest["chunks"], 300) == []
    assert [c["rows"] for c in manifest["chunks"]] == [[i, i + 20] for i in range(0, 300, 20)]
    for fname, inode in committed.items():  # committed chunks were skipped, not rewritten
        assert (pdir / fname).stat().st_ino == inode, fname
    assert cli("collect", run, "--name", name, "--out", tmp_path / "y.npy").returncode == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), _reference(run, x, step),
                               atol=ATOL, rtol=0)


def test_corrupt_or_truncated_chunk_is_detected_and_recomputed(trained, tmp_path):
    run, xpath, x, step = trained
    name = "damaged"
    assert cli("predict", run, "--input", xpath, "--name", name, *CHUNK).returncode == 0
    pdir = run / "predictions" / name
    good = cli("collect", run, "--name", name, "--out", tmp_path / "good.npy")
    assert good.returncode == 0
    flipped, cut = pdir / "chunk-000002.npy", pdir / "chunk-000005.npy"
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0x40
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-8])
    bad = cli("collect", run, "--name", name, "--out", tmp_path / "bad.npy")
    assert bad.returncode == 2
    message = bad.stderr.strip().splitlines()[-1]
    assert "chunk-000002.npy" in message and "chunk-000005.npy" in message
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "bad.npy").exists() and not list(tmp_path.glob(".bad.npy*"))
    # folders --out would have needed are not left behind either (issue 12)
    deep = cli("collect", run, "--name", name, "--out", tmp_path / "new" / "deeper" / "bad.npy")
    assert deep.returncode == 2 and not (tmp_path / "new").exists(), deep.stderr
    # predicting again recomputes exactly the chunks that fail their records
    fixed = cli("predict", run, "--name", name)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "recomputing" in fixed.stderr
    assert cli("collect", run, "--name", name, "--out", tmp_path / "fixed.npy").returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "fixed.npy"), np.load(tmp_path / "good.npy"))


def test_bad_prediction_input_fails_fast(trained, tmp_path):
    run, xpath, x, step = trained
    np.save(tmp_path / "wide.npy", np.zeros((10, 5), np.float32))
    cases = [
        (["--input", tmp_path / "wide.npy"], "--input"),
        (["--input", tmp_path / "missing.npy"], "--input"),
        (["--input", xpath, "--step", "999"], "--step"),
        (["--input", xpath, "--name", "../escape"], "--name"),
        (["--name", "never-made"], "--input"),
        (["--input", tmp_path / "wide.npy", "--name", "held"], "--input"),
    ]
    np.save(tmp_path / "small.npy", x[:40])  # this test's own finished prediction
    held = cli("predict", run, "--input", tmp_path / "small.npy", "--name", "held",
               "--nodes", "1", "--procs-per-node", "1", *CHUNK)
    assert held.returncode == 0, held.stderr[-3000:]
    before = sorted(p.name for p in (run / "predictions").iterdir())
    for args, field in cases:
        done = cli("predict", run, *args)
        assert done.returncode == 2, (args, done.stderr)
        line = done.stderr.strip().splitlines()
        assert len(line) == 1 and field in line[0], (args, done.stderr)
    assert sorted(p.name for p in (run / "predictions").iterdir()) == before
    np.save(tmp_path / "other.npy", x[:50])  # another input under an existing name
    clash = cli("predict", run, "--input", tmp_path / "other.npy", "--name", "held")
    assert clash.returncode == 2 and "another input" in clash.stderr
    exists = tmp_path / "exists.npy"
    exists.write_bytes(b"keep me")
    kept = cli("collect", run, "--name", "held", "--out", exists)
    assert kept.returncode == 2 and exists.read_bytes() == b"keep me"


def test_constant_model_warns_of_collapse_and_bf16_is_checked(tmp_path):
    """A model that outputs a constant triggers the warning. The run predicts in bf16
    (autocast on CPU), so the manifest also records the fp32 re-computation."""
    cfg = small_config(tmp_path, "const", model={"name": "tests.api_models:constant"},
                       training={"epochs": 1, "max_steps": 3, "bf16": "true"},
                       parallel={"nodes": 1, "procs_per_node": 2, "strategy": "ddp"})
    cfg["model"].pop("hidden_sizes")
    done = cli("train", "--config", write_config(tmp_path / "c.yaml", **cfg))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "const"
    np.save(tmp_path / "x.npy", np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32))
    assert cli("predict", run, "--input", tmp_path / "x.npy", "--name", "c").returncode == 0
    manifest = json.loads((run / "predictions" / "c" / "manifest.json").read_text())
    check = manifest["precision_check"]
    assert check["reduced_precision"] and check["dtype"] == "bfloat16"
    assert 0.0 <= check["max_abs_diff"] < 0.05
    assert check["weights_dtype"] == "bfloat16"  # cast on load, not autocast over fp32
    got = cli("collect", run, "--out", tmp_path / "y.npy")
    assert got.returncode == 0, got.stderr
    assert "near-constant" in got.stderr and "max |fp32 - bfloat16|" in got.stderr
    # issue 13 item 6: the inputs vary, the fp32 re-run is as constant: the model itself
    assert manifest["collapse"]["verdict"] == "model", manifest["collapse"]
    assert not manifest["collapse"]["candidates"]["fp32_rerun"]["varies"]
    assert "collapse verdict (model): output 0: the inputs vary" in got.stderr, got.stderr
