"""A causal LM's inputs as users give them (models/lm_inputs.py), refused in one line before
anything is written, where each was an error on every rank once submitted: LoRA targets
that name no layer LoRA adapts, and token ids the model's embedding does not hold (token
arrays, labels of another shape). Real tiny models written by save_pretrained; the users'
world (weights in bf16, ids above 4000) throughout, fp32 beside it for the LoRA typo."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import cli, refused, write_config
from lm_support import (PRECISIONS, assert_refused_before_any_run, bf16_training, lm_config,
                        packed_tokens, prepare_text, tiny_model)


@pytest.fixture(scope="module", params=PRECISIONS)
def saved(request, tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("inputs"), precision=request.param), request.param


@pytest.fixture(scope="module")
def users_model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("inputs-users"), precision="bf16")


def test_a_lora_target_the_model_lacks_is_refused_before_any_run(saved, tmp_path):
    """A typo in lora.target_modules, checked on the model built from config.json on the meta
    device: one line naming the target and the model's own linear layers, nothing written."""
    model, precision = saved
    cfg = lm_config(tmp_path, model, "bad", rows=16, length=16,
                    lora={"target_modules": ["q_proj", "qkv_proj"]},
                    training={"max_steps": 2, **bf16_training(precision)},
                    parallel={"nodes": 1, "procs_per_node": 1})
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg), timeout=120)
    line = refused(res, "lora.target_modules", "['qkv_proj']")
    assert "q_proj, up_proj, v_proj" in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("targets,words", [
    (["q_proj", "input_layernorm"], "['input_layernorm'] name no layer LoRA adapts"),
    (["self_attn.q_proj", "v_proj"], None),  # peft's own match: a name's end, after a dot
])
def test_lora_targets_are_the_layers_peft_adapts(users_model, tmp_path, targets, words):
    """On the users' bf16 model: a norm is a module but not a layer LoRA adapts (peft
    raised on every rank); a dotted name's end is a target as peft matches it."""
    cfg = lm_config(tmp_path, users_model, "bad", rows=16, length=16, lora={"target_modules": targets},
                    training={"max_steps": 2, **bf16_training("bf16")},
                    parallel={"nodes": 1, "procs_per_node": 1})
    res = cli("prepare", "--config", write_config(tmp_path / "run.yaml", **cfg), timeout=120)
    if words is None:
        assert res.returncode == 0, res.stderr[-3000:]
    else:
        refused(res, "lora.target_modules:", words)
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("change,needles", [
    ("id at vocab_size", ["data.train_path: train_x holds token id {vocab}, past the model's "
                          "vocabulary (vocab_size {vocab})"]),
    ("negative label", ["data.train_targets_path: train_y holds token id -7"]),
    ("float ids", ["data.train_path: train_x holds dtype float32, not token ids"]),
    ("labels of another shape", ["data.train_targets_path: train_y has shape (16, 1) but "
                                 "train_x (16, 32); a causal LM's labels are one id per input"]),
    ("ignored labels", None),  # -100: the loss skips them
])
def test_token_arrays_are_ids_the_model_embeds(tmp_path, users_model, change, needles):
    """Token ids given as arrays (not text) for a causal LM: each has a row of the
    embedding (vocab_size of config.json), labels may be -100 and are one per input token;
    else one line at staging, no run (it was an error on every rank: an IndexError, a
    device assert on GPUs, a loss of mismatched shapes)."""
    vocab = json.loads((users_model / "config.json").read_text())["vocab_size"]
    x = packed_tokens(users_model, 16, 32)
    y = x.copy()
    if change == "id at vocab_size":
        x[3, 5] = vocab
    elif change == "negative label":
        y[2, 0] = -7
    elif change == "float ids":
        x = x.astype(np.float32)
    elif change == "labels of another shape":
        y = y[:, :1].copy()
    else:
        y[:, :4] = -100
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    cfg = lm_config(tmp_path, users_model, "arrays", rows=16, length=32, lora={"r": 0},
                    data={"train_path": str(tmp_path / "x.npy"),
                          "train_targets_path": str(tmp_path / "y.npy")})
    res = prepare_text(tmp_path, cfg)
    if needles is None:
        assert res.returncode == 0, res.stderr[-3000:]
    else:
        assert_refused_before_any_run(res, tmp_path, [n.format(vocab=vocab) for n in needles])
