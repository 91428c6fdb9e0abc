"""`export --format hf` streamed (issue 36 section 4): the folder is written tensor by tensor
in the base's dtype (`--dtype` to choose), in shards of `--max-shard-mb`, never from a whole
model; it loads with `from_pretrained` and holds exactly `Run.load_model()`'s fp32 weights
(LoRA merged) cast to the dtype written, for full and LoRA runs, on an fp32 Llama, a bf16
Llama and a bf16 Qwen2 whose head is tied to its embedding (saved in bf16, ids above 4000)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cli, write_config
from lm_support import bf16_training, lm_config, tiny_model

pytestmark = pytest.mark.slow

MODES = ("full", "lora")


@pytest.fixture(scope="module", params=[("llama", "fp32"), ("llama", "bf16"), ("qwen2", "bf16")],
                ids=lambda p: "-".join(p))
def runs(request, tmp_path_factory):
    """A full and a LoRA run of 2 steps on 1 rank over the same tiny model."""
    arch, precision = request.param
    tmp = tmp_path_factory.mktemp(f"hf-stream-{arch}-{precision}")
    model_dir = tiny_model(tmp, arch, precision)
    made = {"tmp": tmp, "base": model_dir, "precision": precision, "arch": arch,
            "dtype": torch.bfloat16 if precision == "bf16" else torch.float32}
    for mode in MODES:
        cfg = lm_config(tmp, model_dir, mode, rows=16, length=16,
                        lora={"r": 0} if mode == "full" else {},
                        training={"max_steps": 2, "lr": 2e-2, **bf16_training(precision)},
                        checkpoint={"every_steps": 2}, parallel={"nodes": 1, "procs_per_node": 1})
        res = cli("train", "--config", write_config(tmp / f"{mode}.yaml", **cfg))
        assert res.returncode == 0, res.stderr[-3000:]
        made[mode] = tmp / "runs" / mode
    made["ids"] = np.load(tmp / "ids.npy")[:4]
    return made


def _export(runs, mode: str, name: str, *extra) -> Path:
    out = runs["tmp"] / f"{mode}-{name}"
    if not out.exists():
        res = cli("export", runs[mode], "--out", out, "--format", "hf", *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    return out


def _written(folder: Path) -> dict:
    """{name: tensor} over every safetensors file of `folder`."""
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                assert name not in out, name
                out[name] = fh.get_tensor(name)
    return out


def _reference(runs, mode: str):
    """Run.load_model(): the fp32 model, LoRA merged by peft."""
    from enn_cluster import Run

    key = f"ref-{mode}"
    if key not in runs:
        runs[key] = Run.open(runs[mode]).load_model()
    return runs[key]


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).float()


def _expected(runs, mode: str) -> dict:
    """What save_pretrained writes of the reference model: a tied pair once (its first name)."""
    lm = _reference(runs, mode).lm
    seen, out = set(), {}
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor.detach()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_export_is_load_models_weights_in_the_bases_dtype(runs, mode):
    from transformers import AutoModelForCausalLM

    from enn_cluster.models.causal_lm import CausalLM

    out = _export(runs, mode, "hf")
    dtype = runs["dtype"]
    written, expected = _written(out), _expected(runs, mode)
    assert set(written) == set(expected)
    for name, tensor in written.items():
        assert tensor.dtype == dtype, (name, tensor.dtype)
        assert torch.equal(tensor, expected[name].to(dtype)), name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert (runs["arch"] == "qwen2") == ("lm_head.weight" not in written)  # tied: once
    loaded = CausalLM(AutoModelForCausalLM.from_pretrained(str(out)).eval())
    assert next(loaded.parameters()).dtype == dtype
    ours = _reference(runs, mode)
    if dtype == torch.float32:
        assert torch.equal(_logits(loaded, runs["ids"]), _logits(ours, runs["ids"]))
    else:  # the same bf16 weights: the same bf16 logits
        cast = CausalLM(AutoModelForCausalLM.from_pretrained(str(runs["base"]))).eval()
        cast.load_state_dict({f"lm.{k}": v.to(dtype) for k, v in expected.items()}, strict=False)
        assert torch.equal(_logits(loaded, runs["ids"]), _logits(cast, runs["ids"]))
    untrained = CausalLM(AutoModelForCausalLM.from_pretrained(str(runs["base"])).eval())
    assert not torch.equal(_logits(loaded, runs["ids"]), _logits(untrained, runs["ids"]))
    record = json.loads((out / "export.json").read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()} - {"export.json"}


@pytest.mark.parametrize("mode", MODES)
def test_a_small_shard_size_splits_the_same_tensors_over_several_files(runs, mode):
    from transformers import AutoModelForCausalLM

    whole = _export(runs, mode, "hf")
    out = _export(runs, mode, "sharded", "--max-shard-mb", "0.05")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    written, single = _written(out), _written(whole)
    assert set(index["weight_map"]) == set(written) == set(single)
    assert all(torch.equal(written[n], single[n]) and written[n].dtype == runs["dtype"]
               for n in written)
    for file in files:  # at most one tensor beyond the limit in a file
        assert (out / file).stat().st_size < 50_000 + max(t.nbytes for t in written.values())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert sum(p.numel() for p in loaded.parameters()) == index["metadata"]["total_parameters"]


def test_dtype_chooses_what_is_written(runs):
    """--dtype float32 on a bf16 base writes fp32 (load_model's weights exactly); on an
    fp32 base --dtype bfloat16 writes bf16."""
    other = "bfloat16" if runs["precision"] == "fp32" else "float32"
    want = getattr(torch, other)
    out = _export(runs, "lora", other, "--dtype", other)
    expected = _expected(runs, "lora")
    for name, tensor in _written(out).items():
        assert tensor.dtype == want and torch.equal(tensor, expected[name].to(want)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == other


@pytest.mark.parametrize("args,field", [(("--format", "hf", "--dtype", "int8"), "--dtype"),
                                        (("--format", "peft", "--dtype", "float32"), "--dtype"),
                                        (("--format", "hf", "--max-shard-mb", "0"),
                                         "--max-shard-mb")])
def test_a_bad_dtype_or_shard_size_is_one_line(runs, args, field):
    out = runs["tmp"] / "bad" / "out"
    res = cli("export", runs["lora"], "--out", out, *args)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].count(field) >= 1, res.stderr
    if args[-1] == "int8":
        assert "bfloat16, float16, float32" in lines[0], lines[0]
    assert not (runs["tmp"] / "bad").exists()


def test_peft_adapters_are_written_in_the_dtype_peft_gives_them(runs):
    """--format peft is unchanged: the adapters alone, in the dtype peft itself makes them
    over this base loaded in its own dtype (fp32: peft upcasts adapters over a bf16 base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = runs["tmp"] / "lora-peft"
    if not out.exists():
        res = cli("export", runs["lora"], "--out", out, "--format", "peft")
        assert res.returncode == 0, res.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(str(runs["base"]), dtype=runs["dtype"])
    theirs = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    want = {p.dtype for n, p in theirs.named_parameters() if ".lora_" in n}
    assert len(want) == 1
    written = _written(out)
    assert written and {t.dtype for t in written.values()} == want
