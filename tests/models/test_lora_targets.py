"""lora.target_modules as words: `attention` (the default) and `all-linear` become the
names peft adapts, found from each architecture's own modules, with peft's own wrapping
as the oracle: the layers it puts adapters on are exactly the decoder layers' attention
linears (or all their linears, as peft's own "all-linear" chooses)."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from enn_cluster.client.llm_assets import ARCHS  # noqa: E402
from enn_cluster.config.lm_config import LoraConfig  # noqa: E402
from enn_cluster.errors import UserError  # noqa: E402
from enn_cluster.models.causal_lm import decoder_layers  # noqa: E402
from enn_cluster.models.lm_inputs import lora_targets  # noqa: E402
from lm_support import SHAPES  # noqa: E402

# what users know their models' attention projections as
KNOWN = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
         "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],  # not its q_norm / k_norm
         "phi3": ["qkv_proj", "o_proj"],
         "gpt_neox": ["query_key_value", "dense"],
         "falcon": ["query_key_value", "dense"],
         "bloom": ["query_key_value", "dense"],
         "gpt2": ["c_attn", "attn.c_proj"],  # the MLP has a c_proj too
         "opt": ["k_proj", "v_proj", "q_proj", "out_proj"]}
ARCH_NAMES = sorted({*ARCHS, *SHAPES} - {"mixtral"})


def built(arch: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {**ARCHS.get(arch, {"model_type": arch}), **SHAPES.get(arch, {})}
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=32064, **shape)  # meta: no memory
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def adapted(lm: nn.Module, targets) -> set[str]:
    """The modules peft's LoRA wraps for `targets` (names or peft's own words)."""
    from peft import LoraConfig as PeftLora, get_peft_model

    peft = get_peft_model(lm, PeftLora(r=2, target_modules=targets, task_type="CAUSAL_LM"))
    return {n.removeprefix("base_model.model.") for n, m in peft.named_modules()
            if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), nn.Module)}


def attention_linears(lm: nn.Module) -> set[str]:
    """Every linear layer (transformers' Conv1D too) inside a module whose class names it as
    attention, in the decoder layers."""
    layers = {id(m) for m in decoder_layers(lm)}
    names = {n for n, m in lm.named_modules() if id(m) in layers}
    return {n for n, m in lm.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
            if any(n.startswith(f"{layer}.") for layer in names)
            and any("Attention" in type(p).__name__ for p in _parents(lm, n))}


def _parents(lm: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [lm.get_submodule(".".join(parts[:k])) for k in range(1, len(parts))]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_attention_is_the_attention_projections_of_every_architecture(arch):
    """The default adapts each decoder layer's attention linears and nothing else, under
    names peft matches (checked by peft wrapping them); for the architectures users know,
    the names they would have written."""
    lm = built(arch)
    targets = lora_targets(lm, LoraConfig(r=2), decoder_layers(lm))
    assert len(set(targets)) == len(targets)
    expected = attention_linears(lm)
    assert expected and adapted(lm, targets) == expected, (targets, sorted(expected))
    if arch in KNOWN:
        assert sorted(targets) == sorted(KNOWN[arch])


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2", "gpt_neox", "gemma3_text"])
def test_all_linear_is_what_peft_calls_all_linear(arch):
    """`all-linear` names the same layers as peft's own all-linear (every linear but the
    output layer), by names a peft export lists."""
    lm = built(arch)
    targets = lora_targets(lm, LoraConfig(r=2, target_modules="all-linear"),
                           decoder_layers(lm))
    assert adapted(built(arch), targets) == adapted(built(arch), "all-linear")
    assert "lm_head" not in targets


def test_a_list_is_kept_as_given_and_checked():
    lm = built("phi3")
    assert lora_targets(lm, LoraConfig(r=2, target_modules=["qkv_proj"]),
                        decoder_layers(lm)) == ["qkv_proj"]
    with pytest.raises(UserError, match=r"^lora.target_modules: \['q_proj'\] match no module"):
        lora_targets(lm, LoraConfig(r=2, target_modules=["q_proj"]), decoder_layers(lm))


def test_a_model_without_attention_in_its_layers_is_one_line():
    """A state-space model's layers hold no attention: `attention` has nothing to stand
    for, so the fix (name the layers) is said with the model's linear layers."""
    lm = built("mamba")
    with pytest.raises(UserError, match="^lora.target_modules: .* no attention module .*"
                                        "name the layers instead, from .*in_proj"):
        lora_targets(lm, LoraConfig(r=2), decoder_layers(lm))
    assert "in_proj" in lora_targets(lm, LoraConfig(r=2, target_modules="all-linear"),
                                     decoder_layers(lm))


@pytest.mark.parametrize("value,says", [
    ("attn", "'attn' must be attention, all-linear or a list of module names"),
    (3, "expected str or list, got int 3"),
])
def test_another_word_is_refused_naming_the_words(tmp_path, value, says):
    from enn_cluster.config.loading import config_from_dict

    with pytest.raises(UserError, match="^lora.target_modules: ") as caught:
        config_from_dict({"model": {"name": "hf:/x"}, "lora": {"r": 4, "target_modules": value}}
                         ).lora.validate()
    assert says in str(caught.value)


@pytest.mark.parametrize("arch,precision", [("phi3", "fp32"), ("phi3", "bf16"),
                                            ("gpt_neox", "bf16")])
def test_lora_on_the_default_targets_trains_as_peft_on_the_named_ones(tmp_path, arch,
                                                                      precision):
    """Phi-3 (one qkv_proj) and GPT-NeoX / Pythia (query_key_value, and a head saved as
    embed_out) with no lora.target_modules given: were refused (`q_proj` matched nothing),
    now 4 steps on 2 ranks equal a plain transformers + peft loop on the names users would
    write, and the checkpoint holds fp32 adapters on exactly those layers."""
    import math

    import numpy as np

    from helpers import cli, metrics, write_config
    from lm_support import (bf16_training, checkpoint_dtypes, lm_config, reference_losses,
                            tiny_model)

    model_dir = tiny_model(tmp_path, arch, precision)
    cfg = lm_config(tmp_path, model_dir, "lora", rows=16, length=32,
                    training={"max_steps": 4, "per_device_train_batch_size": 4,
                              **bf16_training(precision)},
                    checkpoint={"every_steps": 4})
    assert "target_modules" not in cfg["lora"]
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "lora"
    ids = np.load(tmp_path / "ids.npy")
    ours = [r["loss"] for r in metrics(run, "train")]
    t, r = cfg["training"], cfg["lora"]["r"]
    spec = {"r": r, "lora_alpha": cfg["lora"]["alpha"], "lora_dropout": 0.0,
            "target_modules": KNOWN[arch]}
    theirs = reference_losses(model_dir, ids, 4, 8, t["lr"], t["warmup_ratio"], t["seed"],
                              lora=spec, precision=precision)
    assert len(ours) == 4
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert math.isclose(a, b, rel_tol={"fp32": 1e-5, "bf16": 2e-3}[precision]), \
            (step, ours, theirs)
    dtypes = checkpoint_dtypes(run / "checkpoints" / "step-4")
    weights = {n for n in dtypes if n.startswith("model.")}
    assert {dtypes[n] for n in weights} == {"float32"}
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in weights}
    assert layers == {name.rsplit(".", 1)[-1] for name in KNOWN[arch]}, sorted(weights)
    assert all(".lora_" in n for n in weights)
