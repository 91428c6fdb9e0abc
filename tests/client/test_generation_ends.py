"""`predict --generate` stops where transformers' `generate` stops: at any end token of the
model's generation_config.json, which real folders list apart from config.json's one
(Llama-3-Instruct's <|eot_id|>, Phi-3's <|end|>). Only config.json's first was used, so an
instruct model's continuation ran on past the end of its turn. `--seed` samples with the
generation_config's settings (temperature, top_k), as `generate(do_sample=True)` does under
the same seed."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import cli, write_config
from lm_support import PRECISIONS, bf16_training, lm_config, tiny_model

NEW = 6


@pytest.fixture(scope="module", params=PRECISIONS)
def trained(request, tmp_path_factory):
    """A full fine-tune of 2 steps on 2 ranks and its hf export."""
    tmp = tmp_path_factory.mktemp("ends")
    model_dir = tiny_model(tmp, precision=request.param)
    cfg = lm_config(tmp, model_dir, "ends", rows=8, lora={"r": 0},
                    training={"max_steps": 2, **bf16_training(request.param)},
                    checkpoint={"every_steps": 2})
    res = cli("train", "--config", write_config(tmp / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp / "runs" / "ends"
    res = cli("export", run, "--out", tmp / "hf", "--format", "hf")
    assert res.returncode == 0, res.stderr[-3000:]
    x = np.load(tmp / "ids.npy")[:4, :12].copy()
    x[2, 5:] = -1
    np.save(tmp / "rows.npy", x)
    return {"run": run, "base": model_dir, "tmp": tmp, "x": x,
            "dtype": torch.bfloat16 if request.param == "bf16" else torch.float32}


def _transformers(trained):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(trained["tmp"] / "hf"),
                                                dtype=trained["dtype"]).eval()


def _continuations(model, x, seed=None) -> list[list[int]]:
    """transformers' generate of each row (under our per-row seed when sampling), cut after
    the first of the generation_config's end tokens."""
    ends = model.generation_config.eos_token_id
    ends = ends if isinstance(ends, list) else [ends]
    out = []
    for i, row in enumerate(x):
        prompt = torch.from_numpy(row[row >= 0]).long()[None]
        if seed is not None:
            torch.manual_seed(seed * 1_000_003 + i)
        with torch.no_grad():
            made = model.generate(prompt, max_new_tokens=NEW, do_sample=seed is not None,
                                  pad_token_id=ends[0])[0, prompt.shape[1]:].tolist()
        cut = next((k + 1 for k, t in enumerate(made) if t in ends), len(made))
        out.append(made[:cut] + [-1] * (NEW - cut))
    return out


def _predict(trained, name, *extra) -> list[list[int]]:
    res = cli("predict", trained["run"], "--input", trained["tmp"] / "rows.npy", "--name", name,
              "--nodes", 1, "--procs-per-node", 2, "--gpus-per-node", 0, "--chunk-rows", 2,
              "--generate", NEW, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    out = trained["tmp"] / f"{name}.npy"
    res = cli("collect", trained["run"], "--name", name, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    return np.load(out).astype(int).tolist()


def test_generation_stops_at_every_end_token_of_the_generation_config(trained):
    x = trained["x"]
    # the token the trained model writes first on row 0 becomes an end token, as <|eot_id|>
    # is one in Llama-3-Instruct's generation_config.json and not in its config.json
    model = _transformers(trained)
    first = _continuations(model, x[:1])[0]
    end = first[0]
    assert -1 not in first, first  # config.json's end token alone: no stop
    for folder in (trained["base"], trained["tmp"] / "hf"):
        path = folder / "generation_config.json"
        gen = json.loads(path.read_text())
        config_end = json.loads((folder / "config.json").read_text())["eos_token_id"]
        path.write_text(json.dumps(dict(gen, eos_token_id=[config_end, end], temperature=0.7,
                                        top_k=5)))
    model = _transformers(trained)
    want = _continuations(model, x)
    assert want[0] == first[:1] + [-1] * (NEW - 1)  # stopped where transformers stops
    assert _predict(trained, "greedy") == want
    assert _predict(trained, "sharded", "--sharded") == want
    sampled = _predict(trained, "sampled", "--seed", 3)
    assert sampled == _continuations(model, x, seed=3) and sampled != want
    model.generation_config.update(temperature=1.0, top_k=50)  # config.json's defaults
    assert sampled != _continuations(model, x, seed=3)  # so the folder's settings drew it


@pytest.mark.parametrize("gen,config,want", [
    ({"eos_token_id": [7, 9]}, {"eos_token_id": 7}, [7, 9]),  # Llama-3-Instruct's way
    ({"eos_token_id": 9}, {"eos_token_id": [7]}, [9]),
    (None, {"eos_token_id": [7, 8]}, [7, 8]),  # no generation_config.json: config.json's
    ({"do_sample": True}, {"eos_token_id": 7}, [7]),  # it names none: config.json's
    (None, {}, []),
])
def test_end_tokens_are_the_generation_configs_else_the_configs(tmp_path, gen, config, want):
    from enn_cluster.config.hf_name import end_token_ids

    (tmp_path / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert end_token_ids(tmp_path) == want


@pytest.mark.parametrize("text,says", [
    ("{not json", "generation_config.json is not readable JSON"),
    ('{"eos_token_id": "</s>"}', "eos_token_id </s> is not a token id or a list of them"),
    ('{"eos_token_id": [2, -1]}', "eos_token_id [2, -1] is not a token id"),
    ('{"eos_token_id": [2, true]}', "is not a token id"),
])
def test_a_broken_generation_config_is_one_line(tmp_path, text, says):
    from enn_cluster.config.hf_name import end_token_ids
    from enn_cluster.errors import UserError

    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(UserError, match="^model.name: ") as caught:
        end_token_ids(tmp_path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_generate_over_a_broken_generation_config_predicts_nothing(trained):
    """The weights folder is user input: --generate over a generation_config.json that is
    not JSON is refused in one line naming the file, exit 2, nothing predicted."""
    from helpers import refused

    path = trained["base"] / "generation_config.json"
    kept = path.read_text()
    path.write_text("{not json")
    try:
        res = cli("predict", trained["run"], "--input", trained["tmp"] / "rows.npy", "--name",
                  "broken", "--nodes", 1, "--procs-per-node", 1, "--gpus-per-node", 0,
                  "--generate", 2)
    finally:
        path.write_text(kept)
    refused(res, "model.name: ", str(path), "restore the file save_pretrained wrote")
    assert not (trained["run"] / "predictions" / "broken").exists()


@pytest.mark.parametrize("settings,says", [
    ({"temperature": "hot"}, "temperature 'hot' is not a number above 0"),
    ({"temperature": 0}, "temperature 0 is not a number above 0"),
    ({"top_p": 1.5}, "top_p 1.5 is not a number above 0, at most 1"),
    ({"top_k": 2.5}, "top_k 2.5 is not a whole number"),
    ({"top_k": float("inf")}, "top_k inf is not a whole number"),
])
def test_sampling_settings_that_generate_would_fail_on_are_one_line(tmp_path, settings, says):
    """--seed draws with generation_config.json's settings; transformers loads any value
    and fails inside `generate` on every rank, so an unusable one is refused first."""
    from enn_cluster.config.hf_name import check_sampling
    from enn_cluster.errors import UserError

    (tmp_path / "generation_config.json").write_text(json.dumps(settings))
    with pytest.raises(UserError, match="^model.name: ") as caught:
        check_sampling(tmp_path)
    assert says in str(caught.value) and "without --seed" in str(caught.value)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 2]}))
    check_sampling(tmp_path)  # Qwen2.5-Instruct's settings
