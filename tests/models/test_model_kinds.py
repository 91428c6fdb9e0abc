"""The model kind is a contract (issue 41 section 1): every part of the package asks the
run's kind (models.kind_of) instead of branching on the model's name. A third kind, defined
only in tests/toy_kind.py, runs through the real CLI with no edit anywhere else."""
from __future__ import annotations

import json

import numpy as np
import torch

from enn_cluster.config.loading import config_from_dict
from enn_cluster.models import ARRAYS, ArraysKind, kind_of
from enn_cluster.models.causal_lm import CAUSAL_LM, LORA
from helpers import ROOT, cli, write_config
from lm_support import tiny_model
from toy_kind import Bag, BagOfTokens


def test_each_config_has_one_kind(tmp_path):
    model = tiny_model(tmp_path)
    kinds = {name: kind_of(config_from_dict({"model": {"name": name}, "lora": {"r": r}}))
             for name, r in (("mlp", 0), ("transformer", 0), (f"hf:{model}", 0))}
    kinds["lora"] = kind_of(config_from_dict({"model": {"name": f"hf:{model}"},
                                              "lora": {"r": 4}}))
    kinds["factory"] = kind_of(config_from_dict({"model": {"name": "api_models:tiny"}}))
    kinds["toy"] = kind_of(config_from_dict({"model": {"name": "toy_kind:BagOfTokens"}}))
    assert kinds["mlp"] is kinds["transformer"] is kinds["factory"] is ARRAYS
    assert isinstance(ARRAYS, ArraysKind)
    assert kinds[f"hf:{model}"] is CAUSAL_LM and kinds["lora"] is LORA
    assert isinstance(kinds["toy"], BagOfTokens)
    assert CAUSAL_LM.export_formats == ("hf",) and LORA.export_formats == ("hf", "peft")
    assert CAUSAL_LM.predicts_sharded and not ARRAYS.predicts_sharded


def test_a_third_kind_trains_predicts_and_exports_with_no_edit_elsewhere(tmp_path):
    """Token ids with a class hidden in them (the class is which half of the vocabulary
    most ids come from); trained on 2 ranks, predicted on 2: the predictions are the kind's
    own (probabilities), equal to a softmax of the loaded model's logits."""
    tests = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}  # the kind's module, as a user's
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=256)
    x = np.where(rng.random((256, 12)) < 0.8, y[:, None] * 32, (1 - y[:, None]) * 32) + \
        rng.integers(0, 32, size=(256, 12))
    np.save(tmp_path / "x.npy", x.astype(np.int32))
    np.save(tmp_path / "y.npy", y.astype(np.int64))
    cfg = {"run_name": "toy", "runs_root": str(tmp_path / "runs"),
           "model": {"name": "toy_kind:BagOfTokens", "task": "classification", "d_model": 16,
                     "kwargs": {"vocab": 64}},
           "data": {"train_path": str(tmp_path / "x.npy"),
                    "train_targets_path": str(tmp_path / "y.npy")},
           "training": {"max_steps": 12, "per_device_train_batch_size": 16, "lr": 0.05},
           "checkpoint": {"every_steps": 6}, "parallel": {"nodes": 1, "procs_per_node": 2}}
    path = write_config(tmp_path / "run.yaml", **cfg)
    res = cli("plan", "--config", path, "--nodes", 1, "--gpus-per-node", 2, "--json", env=tests)
    assert res.returncode == 0, res.stderr[-3000:]  # the kind's meta build, measured
    params = 64 * 16 + 16 * 2 + 2
    assert json.loads(res.stdout)["trainable_params"] == params, res.stdout
    res = cli("train", "--config", path, env=tests)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "toy"
    res = cli("predict", run, "--input", tmp_path / "x.npy", "--name", "p", "--nodes", 1,
              "--procs-per-node", 2, "--gpus-per-node", 0, "--chunk-rows", 64, env=tests)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("collect", run, "--name", "p", "--out", tmp_path / "p.npy", env=tests)
    assert res.returncode == 0, res.stderr[-3000:]
    probs = np.load(tmp_path / "p.npy")
    from enn_cluster import Run

    model = Run.open(run).load_model()
    assert isinstance(model, Bag)
    with torch.no_grad():
        expect = torch.softmax(model(torch.from_numpy(x)), dim=-1).numpy()
    np.testing.assert_allclose(probs, expect, rtol=1e-5, atol=1e-6)
    assert ((probs.argmax(1) == y).mean()) > 0.9  # it learned
    doctor = cli("doctor", run, env=tests)
    line = next(ln for ln in doctor.stdout.splitlines() if ln.startswith("model"))
    assert " ok " in line and "a bag of 12 tokens into 2 classes" in line, doctor.stdout
    res = cli("export", run, "--out", tmp_path / "out", "--format", "torch", env=tests)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "export.json").read_text())["format"] == "torch"
