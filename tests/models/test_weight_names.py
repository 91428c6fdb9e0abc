"""A weights folder whose tensor names are not the model's (models/weight_names.py):
transformers renames some checkpoints' tensors as it loads them (GPT-NeoX's, Pythia's:
`embed_out` is the model's `lm_head`) and merges others (Mixtral's experts, stacked). Both
were refused at `prepare` as files save_pretrained had not written. A renamed one now
trains as a plain transformers loop does and exports under the folder's own names; a
merged one is refused in one line that says why. Real tiny models written by
save_pretrained, in bf16 with ids above 4000 as users have them, and in fp32."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from helpers import cli, metrics, write_config
from lm_support import (PRECISIONS, assert_refused_before_any_run, bf16_training,
                        checkpoint_dtypes, lm_config, prepare_text, reference_losses,
                        tiny_model)

LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}  # as tests/e2e/test_llm_train.py


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_renamed_checkpoint_trains_and_exports_under_its_own_names(tmp_path, precision):
    """GPT-NeoX: 4 steps on 2 ranks (HSDP 1x2), every loss a plain transformers loop's;
    the checkpoint keeps fp32 weights; `export --format hf` writes `embed_out` as the folder
    does, and transformers loads it to the logits of `Run.load_model()`."""
    from transformers import AutoModelForCausalLM

    from enn_cluster import Run
    from enn_cluster.models.safetensors_header import tensors

    model_dir = tiny_model(tmp_path, "gpt_neox", precision)
    assert "embed_out.weight" in tensors(model_dir)  # what save_pretrained wrote
    cfg = lm_config(tmp_path, model_dir, "neox", rows=16, length=32, lora={"r": 0},
                    training={"max_steps": 4, "per_device_train_batch_size": 4,
                              **bf16_training(precision)},
                    checkpoint={"every_steps": 4})
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "neox"
    ids = np.load(tmp_path / "ids.npy")
    ours = [r["loss"] for r in metrics(run, "train")]
    t = cfg["training"]
    theirs = reference_losses(model_dir, ids, 4, 8, t["lr"], t["warmup_ratio"], t["seed"],
                              precision=precision)
    assert len(ours) == 4
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert math.isclose(a, b, rel_tol=LOSS_TOLERANCE[precision]), (step, ours, theirs)
    assert set(checkpoint_dtypes(run / "checkpoints" / "step-4").values()) == {"float32"}
    res = cli("export", run, "--out", tmp_path / "hf", "--format", "hf", "--dtype", "float32")
    assert res.returncode == 0, res.stderr[-3000:]
    written = tensors(tmp_path / "hf")
    assert "embed_out.weight" in written and "lm_head.weight" not in written, sorted(written)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                    dtype=torch.float32).eval()
    rows = torch.from_numpy(ids[:4]).long()
    with torch.no_grad():
        loaded = Run.open(run).load_model()(rows)
        torch.testing.assert_close(exported(input_ids=rows).logits, loaded, rtol=1e-5, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        assert (base(input_ids=rows).logits - loaded).abs().max() > 1e-3  # it trained


def test_a_checkpoint_whose_tensors_transformers_merges_is_refused_in_one_line(tmp_path):
    """Mixtral's files hold one tensor per expert, which transformers stacks into one as it
    loads them: the workers' per-rank reads cannot, so `prepare` says so, writing nothing."""
    model_dir = tiny_model(tmp_path, "mixtral", "bf16")
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "mixtral"
    cfg = lm_config(tmp_path, model_dir, "moe", rows=16, length=32, lora={"r": 0})
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        "model.name: transformers merges tensors of a mixtral checkpoint as it loads it "
        "(model.layers.0.block_sparse_moe.experts.0.w1.weight into "
        "model.layers.0.mlp.experts.gate_up_proj)", "mixtral models cannot be run here yet"])
