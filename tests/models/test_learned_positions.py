"""Models that learn one embedding per position (GPT-2, OPT): a row longer than their
positions was an IndexError on every rank (a device assert on GPUs) once submitted. Now
the client refuses it in one line before anything is written: text rows (data.max_length),
token arrays, prediction rows, and a generation that would run past the last position;
a model at exactly its positions trains as a plain transformers loop does and generates
as transformers' own `generate`. Rotary models take longer rows, as transformers lets
them. Token arrays wider than data.max_length (the row length the memory plan counts) are
refused for every model. Real tiny models written by save_pretrained, in bf16 with ids
above 4000 as users have them, and in fp32."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from helpers import cli, metrics, refused, write_config
from lm_support import (PRECISIONS, assert_refused_before_any_run, bf16_training,
                        checkpoint_dtypes, corpus, lm_config, packed_tokens, prepare_text,
                        reference_losses, tiny_model, write_texts)

POSITIONS = 32  # the tiny GPT-2's and OPT's n_positions / max_position_embeddings
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}  # as tests/e2e/test_llm_train.py


@pytest.fixture(scope="module", params=PRECISIONS)
def gpt2_run(request, tmp_path_factory):
    """A full fine-tune of the tiny GPT-2 in rows of exactly its 32 positions: 4 steps on
    2 ranks (HSDP 1x2), checkpoint at step 4."""
    tmp = tmp_path_factory.mktemp("gpt2")
    precision = request.param
    model_dir = tiny_model(tmp, arch="gpt2", precision=precision)
    cfg = lm_config(tmp, model_dir, "gpt2", rows=16, length=POSITIONS, lora={"r": 0},
                    training={"max_steps": 4, "per_device_train_batch_size": 4,
                              **bf16_training(precision)},
                    checkpoint={"every_steps": 4})
    res = cli("train", "--config", write_config(tmp / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    return {"tmp": tmp, "model": model_dir, "run": tmp / "runs" / "gpt2", "cfg": cfg,
            "precision": precision}


def test_gpt2_at_its_positions_trains_as_a_plain_transformers_loop(gpt2_run):
    """Every loss equals a plain transformers loop's on the same rows (bf16 autocast for
    the bf16 model, whose ids all lie above 4000), and the checkpoint keeps fp32 weights."""
    precision, cfg = gpt2_run["precision"], gpt2_run["cfg"]
    ids = np.load(gpt2_run["tmp"] / "ids.npy")
    if precision == "bf16":
        assert ids.min() > 4000
    ours = [r["loss"] for r in metrics(gpt2_run["run"], "train")]
    t = cfg["training"]
    theirs = reference_losses(gpt2_run["model"], ids, 4, 8, t["lr"], t["warmup_ratio"],
                              t["seed"], precision=precision)
    assert len(ours) == 4
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert math.isclose(a, b, rel_tol=LOSS_TOLERANCE[precision]), (step, ours, theirs)
    dtypes = checkpoint_dtypes(gpt2_run["run"] / "checkpoints" / "step-4")
    assert set(dtypes.values()) == {"float32"}, dtypes


def _prompts(gpt2_run, name: str, width: int, prompt: int) -> tuple[np.ndarray, str]:
    """Rows 0-3 of the training ids as prompts of `prompt` tokens in rows `width` wide
    (right-padded with -1), saved as `name`.npy."""
    x = np.full((4, width), -1, np.int32)
    ids = np.load(gpt2_run["tmp"] / "ids.npy")
    x[:, :prompt] = ids[:4, :prompt]
    x[1, prompt - 3:] = -1  # one prompt shorter: the longest decides
    path = gpt2_run["tmp"] / f"{name}.npy"
    np.save(path, x)
    return x, str(path)


def _predict(gpt2_run, name: str, path: str, *extra):
    return cli("predict", gpt2_run["run"], "--input", path, "--name", name, "--nodes", 1,
               "--procs-per-node", 2, "--gpus-per-node", 0, "--chunk-rows", 2, *extra,
               timeout=300)


def test_generation_up_to_the_last_position_equals_transformers_generate(gpt2_run):
    """Prompts of 30 tokens may be continued by 3 (positions 0-31: the last new token is
    never fed back): the tokens equal transformers' greedy `generate` of the exported model.
    4 new tokens would need a 33rd position: refused in one line, no prediction written."""
    from transformers import AutoModelForCausalLM

    run, tmp = gpt2_run["run"], gpt2_run["tmp"]
    x, path = _prompts(gpt2_run, "gen", POSITIONS, POSITIONS - 2)
    res = _predict(gpt2_run, "gen-past", path, "--generate", 4)
    refused(res, "--generate: the longest prompt (30 tokens) and 4 new tokens need 33 "
                 "positions, more than the model's 32 positions (n_positions in",
            "generate at most 3 tokens")
    assert not (run / "predictions").exists() or \
        not any(p.name.startswith("gen-past") for p in (run / "predictions").iterdir())
    res = _predict(gpt2_run, "gen", path, "--generate", 3)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("collect", run, "--name", "gen", "--out", tmp / "gen-out.npy")
    assert res.returncode == 0, res.stderr[-3000:]
    made = np.load(tmp / "gen-out.npy")
    res = cli("export", run, "--out", tmp / "hf", "--format", "hf")
    assert res.returncode == 0, res.stderr[-3000:]
    dtype = torch.bfloat16 if gpt2_run["precision"] == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "hf"), dtype=dtype).eval()
    eos = json.loads((gpt2_run["model"] / "config.json").read_text())["eos_token_id"]
    for row, got in zip(x, made):
        prompt = torch.from_numpy(row[row >= 0]).long()[None]
        with torch.no_grad():
            theirs = model.generate(prompt, max_new_tokens=3, do_sample=False,
                                    pad_token_id=eos)[0, prompt.shape[1]:]
        n = int(np.argmax(got == eos)) + 1 if (got == eos).any() else 3
        assert got[:n].astype(int).tolist() == theirs[:n].tolist(), (got, theirs)


def test_prediction_rows_past_the_positions_are_refused(gpt2_run):
    """Scoring forwards a row whole, padding too: rows 33 wide are refused in one line,
    nothing written (rows of token ids may be of any width within the positions)."""
    run = gpt2_run["run"]
    _, path = _prompts(gpt2_run, "wide", POSITIONS + 1, 8)
    refused(_predict(gpt2_run, "wide", path),
            "--input: input has rows of 33 tokens, more than the model's 32 positions "
            "(n_positions in", "cut the rows to 32 tokens or less")
    assert not any(p.name.startswith(("wide", ".staging")) for p in (run / "predictions").iterdir())


@pytest.fixture(scope="module")
def users_models(tmp_path_factory):
    """bf16 models with ids above 4000: GPT-2 and OPT (learned positions, OPT's table two
    rows longer than its max_position_embeddings), Llama (rotary, 512 positions)."""
    tmp = tmp_path_factory.mktemp("positions")
    return {arch: tiny_model(tmp, arch=arch, precision="bf16") for arch in ("gpt2", "opt", "llama")}


def _arrays(tmp_path, model_dir, rows: int, width: int) -> dict:
    x = packed_tokens(model_dir, rows, width)
    np.save(tmp_path / "x.npy", x)
    return {"train_path": str(tmp_path / "x.npy"), "train_targets_path": str(tmp_path / "x.npy")}


@pytest.mark.parametrize("arch,key", [("gpt2", "n_positions"), ("opt", "max_position_embeddings")])
def test_rows_past_learned_positions_are_refused_before_any_run(users_models, tmp_path, arch, key):
    """Text in rows of data.max_length = 33, and token arrays 33 wide: one line at
    `prepare` each, no run; 32 is accepted."""
    model = users_models[arch]
    texts = write_texts(tmp_path / "t.jsonl", corpus(60))
    cfg = lm_config(tmp_path, model, "text", rows=16, length=16, lora={"r": 0},
                    data={"train_path": str(texts), "train_targets_path": "",
                          "max_length": POSITIONS + 1})
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        f"data.max_length: 33 tokens is more than the model's 32 positions ({key} in {model}"
        "/config.json: it learns one embedding per position); set data.max_length to 32"])
    cfg = lm_config(tmp_path, model, "arrays", rows=8, length=POSITIONS + 1, lora={"r": 0},
                    data=_arrays(tmp_path, model, 8, POSITIONS + 1))
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        "data.train_path: train_x has rows of 33 tokens, more than the model's 32 positions",
        "cut the rows to 32 tokens or less"])
    cfg = lm_config(tmp_path, model, "ok", rows=8, length=POSITIONS, lora={"r": 0},
                    data=_arrays(tmp_path, model, 8, POSITIONS))
    res = prepare_text(tmp_path, cfg)
    assert res.returncode == 0, res.stderr[-3000:]


def test_token_arrays_wider_than_max_length_are_refused_and_rotary_rows_run_long(
        users_models, tmp_path):
    """Any model: token arrays wider than data.max_length are refused (the memory plan
    counts rows of data.max_length tokens). A rotary model (Llama, 512 positions) takes
    rows of 600: transformers runs them, so the client does not refuse them."""
    model = users_models["llama"]
    data = _arrays(tmp_path, model, 4, 600)
    cfg = lm_config(tmp_path, model, "wide", rows=4, length=16, lora={"r": 0},
                    data={**data, "max_length": 512})
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        "data.train_path: train_x has rows of 600 tokens, more than data.max_length (512)",
        "set data.max_length: 600"])
    cfg["data"]["max_length"] = 600
    res = cli("train", "--config", write_config(tmp_path / "long.yaml", **cfg),
              "--set", "training.max_steps=1", "--set", "parallel.procs_per_node=1",
              "--set", "training.bf16=true", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(metrics(tmp_path / "runs" / "wide", "train")) == 1
