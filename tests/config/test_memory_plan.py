"""`enn-submit plan`: will it fit? Checked against the public shapes of Llama-3-8B and
Llama-3-70B (their config.json files in tests/data), built on the meta device as the
command builds them; the arithmetic against hand calculations and peft's own count."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import ROOT, cli, controller_up_scontrol, small_config, write_config

from enn_cluster.config.loading import config_from_dict
from enn_cluster.config.memory_plan import (
    GB,
    ModelShape,
    activation_bytes,
    lora_params,
    memory_plan,
    refusal,
    usable_bytes,
)

DATA = ROOT / "tests" / "data"
ISSUE_KEYS = {"params_gb", "grads_gb", "optimizer_gb", "activations_gb", "total_gb", "fits"}
SHAPE = ("--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gb", "80")
SLURM = ("--cluster", "slurm", "--container", "none", "--time", "10", "--partition", "gpu",
         *SHAPE[:4])


def lm_config(tmp_path, size: str, **over) -> dict:
    """A fine-tune of Llama-3-SIZE at 1024 tokens, one row per GPU per micro-batch."""
    return small_config(tmp_path, f"llama-{size}", model={"name": f"hf:{DATA / f'llama-3-{size}'}"},
                        data={"max_length": 1024}, training={"per_device_train_batch_size": 1},
                        **over)


def plan_json(tmp_path, size: str, *sets) -> tuple[int, dict]:
    cfg = write_config(tmp_path / f"{size}.yaml", **lm_config(tmp_path, size))
    res = cli("plan", "--config", cfg, *SHAPE, "--json", *sets)
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


def test_llama_3_8b_full_fine_tune_fits_on_4x8(tmp_path):
    code, plan = plan_json(tmp_path, "8b")
    assert ISSUE_KEYS <= set(plan) and plan["fits"] is True and code == 0
    # 16 bytes per parameter over a shard group of 8 (HSDP: the 8 GPUs of a node)
    assert plan["grads_gb"] + plan["optimizer_gb"] == pytest.approx(8_030_261_248 * 12 / 8 / GB,
                                                                    abs=0.02)
    parts = sum(plan[k] for k in ("params_gb", "grads_gb", "optimizer_gb", "activations_gb"))
    assert plan["total_gb"] == pytest.approx(parts, abs=0.03) and plan["total_gb"] < 71


def test_llama_3_70b_full_fine_tune_does_not_fit_on_4x8_and_says_how(tmp_path):
    cfg = write_config(tmp_path / "70b.yaml", **lm_config(tmp_path, "70b"))
    res = cli("plan", "--config", cfg, *SHAPE)
    assert res.returncode == 1 and "does NOT fit" in res.stdout, res.stderr
    line = res.stdout.strip().splitlines()[-1]
    need = float(line.split(" need ")[1].split()[0])
    assert line.startswith("plan: 4 x 8 GPUs need ") and need > 140  # 16 B x 70.6e9 / 8
    assert "--set lora.r=16 (" in line
    assert "--set parallel.strategy=fsdp (" in line
    assert "--set parallel.activation_checkpointing=full (" in line


def test_llama_3_70b_lora_fits_on_4x8(tmp_path):
    code, plan = plan_json(tmp_path, "70b", "--set", "lora.r=16")
    assert code == 0 and plan["fits"] is True
    # q, k, v, o of 80 layers: 16 x ((8192+8192) + 2 (8192+1024) + (8192+8192))
    assert plan["trainable_params"] == 80 * 16 * (16384 + 2 * 9216 + 16384)
    assert plan["params_gb"] > 70_553_706_496 * 2 / 8 / GB  # the bf16 base, sharded by 8


def test_the_parameter_count_is_the_hand_calculation():
    """Llama-3-8B counted from its config.json by hand: embeddings and head, per layer the
    attention (grouped KV), the SwiGLU MLP and two RMSNorms, and the final norm."""
    from enn_cluster.client.model_shape import model_shape

    c = json.loads((DATA / "llama-3-8b" / "config.json").read_text())
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    hand = 2 * v * h + n * layer + h
    assert hand == 8_030_261_248
    cfg = config_from_dict(lm_config(ROOT, "8b"))
    shape = model_shape(cfg)
    assert shape.params == hand and shape.layers == n and shape.hidden == h and shape.vocab == v
    # FSDP's largest unit: the root's head and final norm (the embedding is a unit of its own)
    assert shape.largest_layer == layer and shape.largest_unit == v * h + h
    assert (shape.intermediate, shape.gated) == (i, True)
    assert shape.loss_chunk_tokens == 2**26 // v  # the loss holds 523 tokens' logits, not 8192


def test_the_activation_estimate_is_what_autograd_saves_for_a_llama_layer(tmp_path):
    """One Llama-shaped layer (i = 3.5 h, 4 query heads per KV head) in bf16 with SDPA on the
    CPU: the bytes autograd saves for backward (counted by saved_tensors_hooks, each storage
    once, parameters left out), from a 2-layer model less a 1-layer one, are within 15 % of
    the plan's per-layer figure; the plan's logits term covers what the rest saves."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from enn_cluster.client.model_shape import model_shape
    from enn_cluster.config.memory_plan import LOGIT_BYTES, layer_bytes_per_token

    s, h, vocab = 128, 256, 512
    shape = dict(hidden_size=h, intermediate_size=7 * h // 2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=vocab, attn_implementation="sdpa")

    def saved(layers: int) -> int:
        config = AutoConfig.for_model("llama", num_hidden_layers=layers, **shape)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        ids = torch.randint(0, vocab, (1, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids)
        return sum(n for ptr, n in seen.items() if ptr not in params)

    one, two = saved(1), saved(2)
    AutoConfig.for_model("llama", num_hidden_layers=1, **shape).save_pretrained(str(tmp_path))
    ours = model_shape(config_from_dict(small_config(tmp_path, model={"name": f"hf:{tmp_path}"})))
    assert ours.gated and ours.intermediate == 7 * h // 2
    assert (two - one) == pytest.approx(layer_bytes_per_token(ours) * s, rel=0.15)
    assert one - (two - one) <= LOGIT_BYTES * s * vocab


@pytest.mark.parametrize("arch,targets,peft_targets", [
    ("llama", ["q_proj", "v_proj", "down_proj"], ["q_proj", "v_proj", "down_proj"]),
    ("phi3", "attention", ["qkv_proj", "o_proj"]),  # the default, as Phi-3 names it
])
def test_the_lora_count_is_peft_s(tmp_path, arch, targets, peft_targets):
    """r x (in + out) per targeted Linear equals the trainable parameters peft gives a tiny
    model (built on the CPU, as the run would wrap it) on the layers the targets name."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from enn_cluster.client.llm_assets import ARCHS
    from enn_cluster.client.model_shape import model_shape

    shape = dict(ARCHS.get(arch, ARCHS["llama"]), model_type=arch)
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=300, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, **shape)
    config.save_pretrained(str(tmp_path / "tiny"))
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_config(config),
                                LoraConfig(r=8, target_modules=peft_targets))
    trainable, total = peft_model.get_nb_trainable_parameters()
    cfg = config_from_dict(small_config(tmp_path, model={"name": f"hf:{tmp_path / 'tiny'}"},
                                        lora={"r": 8, "target_modules": targets}))
    shape = model_shape(cfg)
    assert sorted(shape.lora_targets) == sorted(peft_targets)
    assert lora_params(shape.linears, shape.lora_targets, 8) == trainable
    assert shape.params == total - trainable


def _shape(**over) -> ModelShape:
    return replace(ModelShape(params=1000, layers=4, hidden=8, tokens=0, vocab=10,
                              largest_unit=300, largest_layer=150), **over)


def test_the_arithmetic_per_strategy_and_checkpointing():
    """Bytes per rank, by hand: 16 per parameter over the shard group, the gathered units in
    bf16, 34 s h b per layer, a checkpointed layer 2 s h b plus one recomputed."""
    base = config_from_dict({"model": {"name": "hf:/x"}, "data": {"max_length": 16},
                             "training": {"per_device_train_batch_size": 2}})
    shape = _shape()
    hsdp = memory_plan(base, shape, 2, 4)
    assert hsdp.shard_group == 4 and hsdp.params == 1000 * 4 / 4 + (300 + 150) * 2
    assert hsdp.grads == 1000 * 4 / 4 and hsdp.optimizer == 1000 * 8 / 4
    logits = 16 * 10 * 2 * 10
    assert hsdp.activations == hsdp.activations_none == 4 * 34 * 16 * 8 * 2 + logits
    assert hsdp.activations_full == 4 * 2 * 16 * 8 * 2 + 34 * 16 * 8 * 2 + logits
    swiglu = memory_plan(base, _shape(intermediate=28, gated=True), 2, 4)  # i = 3.5 h
    assert swiglu.activations_none == 4 * 45 * 16 * 8 * 2 + logits
    fsdp = memory_plan(replace(base, parallel=replace(base.parallel, strategy="fsdp")), shape, 2, 4)
    assert fsdp.shard_group == 8 and fsdp.optimizer == 1000
    ddp = memory_plan(replace(base, parallel=replace(base.parallel, strategy="ddp")), shape, 2, 4)
    assert ddp.shard_group == 1 and ddp.params == 4000  # whole, nothing gathered
    fp32 = memory_plan(replace(base, training=replace(base.training, bf16="false")), shape, 2, 4)
    assert fp32.activations - logits == 2 * (hsdp.activations - logits)
    chunked = memory_plan(base, _shape(loss_chunk_tokens=8), 2, 4)  # 8 of 32 tokens' logits
    assert chunked.activations == hsdp.activations - logits + 8 * 10 * 10
    # every other of 4 layers keeps its input of 2 bytes, and one is rebuilt at a time
    assert activation_bytes(4, 34.0, 1.0, 1, "every_other") == 2 * 34 + 2 * 2 + 34
    # per op: every layer keeps what the policy saves (here 12 of 34), one layer's rest rebuilt
    assert activation_bytes(4, 34.0, 1.0, 1, "selective", 12.0) == 4 * 12 + (34 - 12)
    none, sel, other, full = (memory_plan(replace(base, parallel=replace(
        base.parallel, activation_checkpointing=m)), shape, 2, 4).activations
        for m in ("none", "selective", "every_other", "full"))
    assert none > sel and full < sel
    assert usable_bytes(80) == pytest.approx(71 * GB)
    assert hsdp.fits and not memory_plan(base, _shape(params=10**12), 2, 4).fits


def test_a_plan_that_fits_is_not_refused_and_one_that_does_not_names_fixes_that_fit():
    base = config_from_dict({"model": {"name": "hf:/x"}, "data": {"max_length": 16}})
    assert refusal(base, _shape(), 1, 8) == ""
    big = _shape(params=40 * 10**9, largest_unit=10**8, largest_layer=10**8)
    line = refusal(base, big, 1, 8)  # 80 GB of fp32 state per GPU
    assert "\n" not in line and "--set lora.r=16" in line and "fits" in line
    # a smaller micro-batch keeps the run's rows per step: 32 x 8 ranks
    assert "--set training.per_device_train_batch_size=1 --set " \
        "training.global_batch_size=256 (" in line
    assert refusal(replace(base, parallel=replace(base.parallel, strategy="fsdp")), big, 1, 8) \
        .count("or more nodes") == 1


def test_when_no_fix_fits_alone_the_cheapest_pair_that_fits_is_offered():
    """A model whose state needs FSDP over 8 and whose activations need full checkpointing:
    neither fits alone; the pair does, and comes first (issue 36: the 70B on 4 x 8 was
    offered fsdp and checkpointing apart, never both)."""
    base = config_from_dict({"model": {"name": "hf:/x"}, "data": {"max_length": 4096},
                             "training": {"per_device_train_batch_size": 1}})
    big = _shape(params=20 * 10**9, layers=40, hidden=8192, largest_unit=10**8,
                 largest_layer=10**8)
    line = refusal(base, big, 2, 4)
    assert line and "\n" not in line
    fixes = line.split("fix: ", 1)[1]
    first = fixes.split(", --set ")[0]
    assert first.startswith("--set parallel.strategy=fsdp --set "
                            "parallel.activation_checkpointing=full (") and "fits" in first, line
    pair = memory_plan(replace(base, parallel=replace(base.parallel, strategy="fsdp",
                                                      activation_checkpointing="full")),
                       big, 2, 4)
    assert pair.fits and f"({pair.total / GB:.1f} GB, fits)" in first
    rest = fixes[len(first):]  # each alone too, with its total, not fitting
    for alone in ("--set parallel.strategy=fsdp (", "--set parallel.activation_checkpointing"
                                                    "=full ("):
        assert alone in rest and rest.split(alone)[1].split(")")[0].endswith("GB"), line


def test_train_on_slurm_refuses_a_plan_that_cannot_fit_before_writing(tmp_path):
    """The plan is refused before the job is built or submitted (the sbatch here would
    refuse anything)."""
    cfg = write_config(tmp_path / "70b.yaml", **lm_config(tmp_path, "70b"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    res = cli("train", "--config", cfg, *SLURM, env={"PATH": str(bin_dir)})
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("enn-submit: error: plan: 4 x 8 GPUs need ") and "lora.r=16" in line
    assert not (tmp_path / "runs").exists()


def test_prepare_refuses_on_the_site_s_gpus(tmp_path):
    """The 8B fits 80 GB GPUs, not the 20 GB ones the site config names."""
    cfg = write_config(tmp_path / "8b.yaml", **lm_config(tmp_path, "8b"))
    site = write_config(tmp_path / "site.yaml", gpu_mem_gb=20)
    res = cli("prepare", "--config", cfg, *SHAPE[:4], env={"ENN_SITE_CONFIG": str(site)})
    assert res.returncode == 2 and "but 17.0 of 20 GB are usable" in res.stderr, res.stderr
    assert "--set parallel.strategy=fsdp (" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_built_in_model_is_planned_from_its_data(tmp_path):
    cfg = write_config(tmp_path / "mlp.yaml", **small_config(tmp_path))
    res = cli("plan", "--config", cfg, "--nodes", "1", "--gpus-per-node", "2", "--json")
    plan = json.loads(res.stdout)
    # 8 features -> 16 -> 16 -> 1
    assert res.returncode == 0 and plan["fits"] and plan["trainable_params"] == \
        (8 * 16 + 16) + (16 * 16 + 16) + (16 + 1)



@pytest.mark.parametrize("config_json, why", [
    (None, "names no directory with a config.json"),
    ('{"model_type": "no-such-arch"}', "no usable config.json"),
    ('{"model_type": "t5"}', "'t5' is not a causal LM transformers can build"),
])
def test_a_weights_directory_plan_cannot_build_is_one_line(tmp_path, config_json, why):
    from enn_cluster.client.model_shape import model_shape
    from enn_cluster.errors import UserError

    if config_json is not None:
        (tmp_path / "config.json").write_text(config_json)
    cfg = config_from_dict(small_config(tmp_path, model={"name": f"hf:{tmp_path}"}))
    with pytest.raises(UserError, match=f"^model.name: '?hf:{tmp_path}'?:? ") as err:
        model_shape(cfg)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_the_refusal_names_each_fix_in_the_api_s_keyword_sections():
    """The same refusal from the API: each --set fix is the keyword section train() takes
    (the error's API rendering), and no flag is left in it."""
    from enn_cluster.config.memory_plan import memory_refusal

    base = config_from_dict({"model": {"name": "hf:/x"}, "data": {"max_length": 16}})
    big = _shape(params=40 * 10**9, largest_unit=10**8, largest_layer=10**8)
    refused = memory_refusal(base, big, 1, 8)
    assert str(refused) == refusal(base, big, 1, 8)
    api = refused.rendered("api")
    assert "lora={'r': 16} (" in api and "--set" not in api, api
    assert "training={'per_device_train_batch_size': 1} training={'global_batch_size': 256} (" \
        in api, api
    assert memory_refusal(base, _shape(), 1, 8) is None
