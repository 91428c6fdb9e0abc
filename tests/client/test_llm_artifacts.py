"""A fine-tuned causal LM leaves the runtime as transformers and peft expect it (issue 24):
the `--format hf` export, `Run.load_model()` and peft's own merge of the `--format peft`
adapter give the same logits; prediction's scores and greedy generations equal a plain
transformers forward and `generate` of the exported model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import cli, refused, write_config
from lm_support import PRECISIONS, bf16_training, lm_config, tiny_model

# bf16 (the users' world: a bf16 checkpoint, ids above 4000, training and prediction in bf16)
# is held to transformers in bf16 on the same weights; scores agree to bf16 round-off (a
# batch of padded rows against one row at a time), fp32 to float32 round-off.
SCORE_ATOL = {"fp32": 1e-4, "bf16": 3e-2}


@pytest.fixture(scope="module", params=PRECISIONS)
def trained(request, tmp_path_factory):
    """A LoRA run of 6 steps on 2 ranks, its hf and peft exports."""
    tmp = tmp_path_factory.mktemp("lm-art")
    precision = request.param
    model_dir = tiny_model(tmp, precision=precision)
    cfg = lm_config(tmp, model_dir, "lora",
                    training={"max_steps": 6, "lr": 2e-2, **bf16_training(precision)},
                    checkpoint={"every_steps": 3})
    res = cli("train", "--config", write_config(tmp / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp / "runs" / "lora"
    for fmt in ("hf", "peft"):
        res = cli("export", run, "--out", tmp / fmt, "--format", fmt)
        assert res.returncode == 0, res.stderr[-3000:]
    return {"run": run, "base": model_dir, "tmp": tmp, "ids": np.load(tmp / "ids.npy")[:6],
            "precision": precision,
            "dtype": torch.bfloat16 if precision == "bf16" else torch.float32}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).logits


def test_hf_export_load_model_and_peft_merge_give_the_same_logits(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from enn_cluster import Run

    ids = trained["ids"]
    fp32 = {"dtype": torch.float32}  # a bf16 base upcast: the merge and logits in fp32
    exported = AutoModelForCausalLM.from_pretrained(str(trained["tmp"] / "hf"), **fp32).eval()
    ours = Run.open(trained["run"]).load_model()
    with torch.no_grad():
        loaded = ours(torch.from_numpy(ids))
    base = AutoModelForCausalLM.from_pretrained(str(trained["base"]), **fp32)
    merged = PeftModel.from_pretrained(base, str(trained["tmp"] / "peft")).merge_and_unload().eval()
    reference = _logits(merged, ids)
    # --format hf writes the base's dtype: a bf16 base gets peft's fp32 merge rounded once
    rounded = AutoModelForCausalLM.from_pretrained(str(trained["base"]), **fp32).eval()
    rounded.load_state_dict({k: v.to(trained["dtype"]).float()
                             for k, v in merged.state_dict().items()})
    torch.testing.assert_close(_logits(exported, ids), _logits(rounded, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded, reference, rtol=1e-5, atol=1e-5)
    untrained = AutoModelForCausalLM.from_pretrained(str(trained["base"]), **fp32).eval()
    assert (reference - _logits(untrained, ids)).abs().max() > 1e-3  # the adapters learned
    # the default targets, `attention`, as the names peft wrapped
    spec = json.loads((trained["tmp"] / "peft" / "adapter_config.json").read_text())
    assert sorted(spec["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    tok = AutoTokenizer.from_pretrained(str(trained["tmp"] / "hf"))
    assert tok("the cluster").input_ids == \
        AutoTokenizer.from_pretrained(str(trained["base"]))("the cluster").input_ids


def _predict(trained, name, *extra):
    """Rows 0-5 of the training ids, three of them shortened (right-padded with -1; one to a
    single token), predicted on 2 ranks in chunks of 2 rows (3 chunks: one rank has one
    more than the other). Each prediction is made once per module (tests compare with the
    same ones)."""
    made = trained.setdefault("predictions", {})
    if name not in made:
        made[name] = _predict_now(trained, name, *extra)
        trained.setdefault("logs", {})[name] = max(
            (d for d in (trained["run"] / "logs").iterdir() if d.is_dir()),
            key=lambda d: d.stat().st_mtime)  # the workers' logs of this prediction
    return made[name]


def _predict_now(trained, name, *extra, path=None):
    """Rows 0-5 as _predict says, or the rows saved at `path`."""
    if path is None:
        x = trained["ids"].copy()
        x[2, 20:] = -1  # a shorter row, right-padded
        x[4, 5:] = -1
        x[5, 1:] = -1  # a one-token prompt: nothing to score (NaN), a continuation to generate
        path = trained["tmp"] / f"{name}.npy"
        np.save(path, x)
    x = np.load(path)
    res = cli("predict", trained["run"], "--input", path, "--name", name,
              "--nodes", 1, "--procs-per-node", 2, "--gpus-per-node", 0, "--chunk-rows", 2, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    out = trained["tmp"] / f"{name}-out.npy"
    res = cli("collect", trained["run"], "--name", name, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    return x, np.load(out)


def test_predicted_scores_equal_a_plain_transformers_forward(trained):
    x, scores = _predict(trained, "scores")
    logs = trained["logs"]["scores"]
    said = [(logs / f"rank-{r}.log").read_text() for r in range(2)]
    # one node of 2 ranks: rank 0 reads the base weights and the checkpoint, rank 1 receives
    assert "tensors from the checkpoint, the rest from" in said[0], said[0][-2000:]
    assert "LM replica of step-" in said[1] and "received from rank 0" in said[1], said[1][-2000:]
    _assert_transformers_scores(trained, x, scores)


def _exported(trained):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(trained["tmp"] / "hf"),
                                                dtype=trained["dtype"]).eval()


def _assert_transformers_scores(trained, x, scores) -> None:
    """Each row's [mean log-likelihood, n] is the exported model's forward of the row."""
    model = _exported(trained)
    for row, (mean, n) in zip(x, scores):
        ids = torch.from_numpy(row[row >= 0]).long()[None]
        logp = torch.log_softmax(_logits(model, ids.numpy())[0, :-1].float(), -1)
        expect = logp.gather(-1, ids[0, 1:, None])[:, 0]
        assert n == len(expect)
        if n == 0:  # one token: no score (NaN), never a perfect 0.0
            assert np.isnan(mean), mean
            continue
        assert abs(mean - float(expect.mean())) < SCORE_ATOL[trained["precision"]], \
            (mean, float(expect.mean()))


def test_greedy_generation_equals_transformers_generate(trained):
    x, made = _predict(trained, "gen", "--generate", 5)
    _assert_transformers_generate(trained, x, made, 5)


def _assert_transformers_generate(trained, x, made, new_tokens: int) -> None:
    """Each row's continuation is the exported model's greedy `generate`, -1 after EOS."""
    model = _exported(trained)
    assert made.shape == (len(x), new_tokens)
    for row, ours in zip(x, made):
        prompt = torch.from_numpy(row[row >= 0]).long()[None]
        with torch.no_grad():
            theirs = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=model.config.eos_token_id)[0, prompt.shape[1]:]
        eos = (theirs == model.config.eos_token_id).nonzero()
        keep = int(eos[0]) + 1 if len(eos) else len(theirs)
        assert ours[:keep].tolist() == theirs[:keep].float().tolist()
        assert (ours[keep:] == -1).all()


def test_rows_of_any_width_predict_as_transformers_does(trained):
    """Rows of token ids need not be as wide as the training rows (32 here): prompts 12
    wide are scored (replicas) and continued (--sharded) as transformers does them; rows
    of another number of dimensions are refused in one line."""
    x = trained["ids"][:, :12].copy()
    x[4, 5:] = -1
    x[5, 1:] = -1
    path = trained["tmp"] / "narrow.npy"
    np.save(path, x)
    _assert_transformers_scores(trained, x, _predict_now(trained, "narrow", path=path)[1])
    made = _predict_now(trained, "narrow-gen", "--generate", 4, "--sharded", path=path)[1]
    _assert_transformers_generate(trained, x, made, 4)
    np.save(path, x[:, :, None])
    res = cli("predict", trained["run"], "--input", path, "--name", "cube", "--nodes", 1,
              "--procs-per-node", 2, "--gpus-per-node", 0)
    refused(res, "--input: rows have shape (12, 1) but the model was trained on rows of "
                 "shape (32,)")


def test_doctor_reads_an_lm_run(trained):
    res = cli("doctor", trained["run"])
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.strip()}
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert " ok " in lines["model"] and "LoRA r=4" in lines["model"], lines["model"]
    assert "--format hf" in lines["export"], lines["export"]


def test_a_sharded_model_predicts_what_the_replicas_predict(trained):
    """--sharded (the default when one GPU cannot hold the model): FSDP over the 2 ranks, no
    rank holding the whole model, the rank with fewer chunks running idle forwards to meet its
    peer's collectives. Scores and greedy continuations equal the replicas'."""
    _, replicas = _predict(trained, "scores")
    _, sharded = _predict(trained, "scores-s", "--sharded")
    np.testing.assert_allclose(sharded, replicas, rtol=1e-5,
                               atol=1e-5 if trained["precision"] == "fp32" else SCORE_ATOL["bf16"])
    _, made_r = _predict(trained, "gen", "--generate", 5)
    _, made_s = _predict(trained, "gen-s", "--generate", 5, "--sharded")
    np.testing.assert_array_equal(made_s, made_r)
    request = (trained["run"] / "predictions" / "scores-s" / "request.json").read_text()
    assert '"sharded": true' in request
