"""Issue 13 item 6: a near-constant prediction is traced to its cause. The prediction
manifest records the candidates (per-sample input, fp32 re-run, raw, denormalised,
calibrated) and the verdict; collect prints it. One deliberately collapsed case per kind
(the model that outputs a constant: test_predict.py)."""
from __future__ import annotations

import json

import numpy as np

from helpers import cli, small_config, write_config

ONE_PROC = {"nodes": 1, "procs_per_node": 1}


def _train(tmp_path, name: str, y_fn, **over) -> tuple:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((128, 8)).astype(np.float32)
    np.savez(tmp_path / f"{name}.npz", x=x, y=y_fn(x, rng).astype(np.float32))
    cfg = small_config(tmp_path, name, parallel=ONE_PROC, checkpoint={"every_steps": 2})
    cfg["data"].update(train_path=str(tmp_path / f"{name}.npz"), eval_fraction=0.0)
    cfg["training"]["max_steps"] = 2
    for section, values in over.items():
        cfg[section].update(values)
    done = cli("train", "--config", write_config(tmp_path / f"{name}.yaml", **cfg), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "runs" / name, x


def _predict(tmp_path, run, x, name: str) -> tuple[dict, str]:
    np.save(tmp_path / f"{name}.npy", x)
    done = cli("predict", run, "--input", tmp_path / f"{name}.npy", "--name", name,
               "--chunk-rows", "48", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = cli("collect", run, "--name", name, "--out", tmp_path / f"{name}-out.npy")
    assert got.returncode == 0, got.stderr
    manifest = json.loads((run / "predictions" / name / "manifest.json").read_text())
    return manifest, got.stderr


def test_identical_input_rows_and_targets_that_barely_vary(tmp_path):
    """Targets 3 + 1e-7 noise, normalised for training: the raw outputs vary, the
    denormalised ones cannot (verdict denormalization). The same model fed one row
    repeated: verdict input."""
    run, x = _train(tmp_path, "tiny", lambda x, rng: 3.0 + 1e-7 * rng.standard_normal((len(x), 1)),
                    data={"normalize_targets": True})
    manifest, stderr = _predict(tmp_path, run, x, "varied")
    verdict = manifest["collapse"]
    assert verdict["verdict"] == "denormalization", verdict
    assert verdict["candidates"]["raw"]["varies"] and verdict["candidates"]["input"]["varies"]
    assert verdict["candidates"]["calibrated"] is None
    assert "collapse verdict (denormalization): output 0: the raw outputs vary" in stderr, stderr
    assert "--raw" in stderr
    same, stderr = _predict(tmp_path, run, np.repeat(x[:1], 100, axis=0), "same")
    assert same["collapse"]["verdict"] == "input" and same["input_spread"] == 0.0
    assert "collapse verdict (input): output 0: every input row is the same" in stderr, stderr


def test_bf16_rounds_the_variation_away_and_the_fp32_rerun_shows_it(tmp_path):
    """Outputs 99840 +- 150 predicted in bf16 are all 99840; the fp32 re-run of the first
    batch varies: verdict precision, naming the fix."""
    run, x = _train(tmp_path, "off", lambda x, rng: np.tanh(x[:, :1]),
                    model={"name": "tests.api_models:offset"}, training={"bf16": "true", "lr": 1e-6})
    manifest, stderr = _predict(tmp_path, run, x, "p")
    verdict = manifest["collapse"]
    assert verdict["verdict"] == "precision", verdict
    rerun = verdict["candidates"]["fp32_rerun"]
    assert rerun["std"] > 100 and rerun["reduced_std"] == 0.0, rerun
    assert "collapse verdict (precision)" in stderr and "--set training.bf16=false" in stderr
