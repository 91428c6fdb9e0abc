"""Hostile files around a causal LM run (issue 28): a forged DCP `.metadata` (empty,
truncated, describing no tensor) is refused by every export format before any weight is
written, and the LM's readers of user input (the weights directory, its tokenizer files)
refuse a FIFO, /dev/zero, a symlink loop or a directory in one line, exit 2, never hanging;
an HF cache snapshot, whose files are symlinks into blobs/, still exports."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, cli, refused, write_config
from lm_support import bf16_training, copy_model, corpus, lm_config, tiny_model, write_texts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A LoRA run of 2 steps on 1 rank, with its committed step-2, in the users' world
    (weights saved in bf16, ids above 4000, bf16 compute)."""
    tmp = tmp_path_factory.mktemp("lm-hostile")
    model_dir = tiny_model(tmp, precision="bf16")
    cfg = lm_config(tmp, model_dir, "lora", rows=16, length=16,
                    training={"max_steps": 2, **bf16_training("bf16")},
                    checkpoint={"every_steps": 2},
                    parallel={"nodes": 1, "procs_per_node": 1})
    res = cli("train", "--config", write_config(tmp / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    return {"run": tmp / "runs" / "lora", "model": model_dir}


def _forge(step: Path, data: bytes) -> None:
    """`.metadata` replaced by `data`, the commit record forged to match (a writer of the
    run can do both: checksums catch damage, not a hostile writer)."""
    from enn_cluster.storage.checksum import file_checksum

    (step / ".metadata").write_bytes(data)
    record = json.loads((step / "commit.json").read_text())
    size, checksum = file_checksum(step / ".metadata")
    record["files"][".metadata"] = {"size": size, "checksum": checksum}
    (step / "commit.json").write_text(json.dumps(record))


def _empty_metadata(_old: bytes) -> bytes:
    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata={}))


FORGED = {"describes-nothing": _empty_metadata, "truncated": lambda old: old[: len(old) // 2],
          "empty-file": lambda old: b""}


@pytest.mark.parametrize("kind,fmt", [("describes-nothing", "torch"), ("describes-nothing", "hf"),
                                      ("describes-nothing", "peft"), ("truncated", "hf"),
                                      ("empty-file", "peft")])
def test_export_of_a_forged_metadata_is_refused_in_one_line(lm_run, tmp_path, fmt, kind):
    run = tmp_path / "run"
    shutil.copytree(lm_run["run"], run, symlinks=True)
    step = run / "checkpoints" / "step-2"
    _forge(step, FORGED[kind]((step / ".metadata").read_bytes()))
    out = tmp_path / "new" / "out"  # a parent the export would make: gone again too
    res = cli("export", run, "--out", out, "--format", fmt, timeout=120)
    refused(res, "step-2")
    assert not (tmp_path / "new").exists()


def _plant(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "loop":
        os.symlink(path.name, path)
    else:
        path.mkdir()


@pytest.mark.parametrize("name,kind", [("model.safetensors", "fifo"),
                                       ("model.safetensors", "devzero"),
                                       ("model.safetensors", "loop"), ("config.json", "dir"),
                                       ("tokenizer.json", "fifo")])
def test_a_weights_dir_file_that_is_not_a_file_is_one_line(lm_run, tmp_path, name, kind):
    """The weights directory is user input outside the run: the run's config names it, so
    it is planted in place and restored after."""
    target = lm_run["model"] / name
    kept = tmp_path / name
    shutil.copy2(target, kept)
    try:
        _plant(target, kind)
        res = cli("export", lm_run["run"], "--out", tmp_path / "out", "--format", "hf",
                  timeout=120)
        refused(res, "model.name")
        assert not (tmp_path / "out").exists()
    finally:
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink()
        shutil.move(kept, target)


def test_an_hf_cache_snapshot_of_symlinks_into_blobs_exports(lm_run, tmp_path):
    """Each file of the weights directory a symlink into a blobs/ folder beside it, as the
    Hugging Face cache keeps a snapshot: the LoRA base check reads through them, the export
    is written."""
    model = lm_run["model"]
    blobs = model.parent / "blobs"
    blobs.mkdir()
    moved = []
    try:
        for file in sorted(model.iterdir()):
            if file.is_file():
                shutil.move(file, blobs / file.name)
                os.symlink(blobs / file.name, file)
                moved.append(file)
        res = cli("export", lm_run["run"], "--out", tmp_path / "out", "--format", "peft",
                  timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        assert (tmp_path / "out" / "adapter_config.json").is_file()
    finally:
        for file in moved:
            file.unlink()
            shutil.move(blobs / file.name, file)
        blobs.rmdir()

def _custom_code_folder(model_dir: Path, dest: Path, marker: Path) -> Path:
    """A weights folder whose config.json names a model type transformers does not know and
    an `auto_map` into a Python file of the folder: loading it would run that file."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type="enn_custom_arch", auto_map={
        "AutoConfig": "modeling_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomLM"})
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "modeling_custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(0)\n")
    return dest


def test_a_weights_folder_asking_for_custom_code_is_refused_without_a_prompt(lm_run, tmp_path):
    """Issue 38 section 2: `prepare` (a keyboard on stdin answering y) refuses in one line
    naming the file and the model type; nothing of the folder runs, nothing waits."""
    marker = tmp_path / "ran"
    weights = _custom_code_folder(lm_run["model"], tmp_path / "custom", marker)
    cfg = lm_config(tmp_path, weights, "custom", rows=16, length=16,
                    parallel={"nodes": 1, "procs_per_node": 1})
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "prepare", "--config",
                          str(write_config(tmp_path / "run.yaml", **cfg))], input="y\n",
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = refused(res, "model.name")
    assert f"{weights}/config.json" in line and "enn_custom_arch" in line, line
    assert "custom code" in line and "[y/N]" not in res.stdout + res.stderr
    assert not marker.exists() and not (tmp_path / "runs" / "custom").exists()


def test_export_of_a_run_whose_weights_now_ask_for_custom_code_is_one_line(lm_run, tmp_path):
    """The same folder put where a finished run's weights were: `export` refuses in one
    line (it was a raw ValueError traceback), and nothing of the folder runs."""
    marker = tmp_path / "ran"
    kept = tmp_path / "kept"
    shutil.move(lm_run["model"], kept)
    try:
        _custom_code_folder(kept, lm_run["model"], marker)
        res = cli("export", lm_run["run"], "--out", tmp_path / "out", "--format", "hf",
                  timeout=120)
        line = refused(res, "model.name")
        assert "custom code" in line and "enn_custom_arch" in line, line
        assert not marker.exists() and not (tmp_path / "out").exists()
    finally:
        shutil.rmtree(lm_run["model"], ignore_errors=True)
        shutil.move(kept, lm_run["model"])


def test_a_tokenizer_changed_after_training_is_refused_by_predict_and_export(lm_run, tmp_path):
    """Issue 38 section 5: a run that tokenized text keeps its tokenizer's checksum; once
    the weights folder's tokenizer changes, text prediction and `export --format hf` (which
    ships the tokenizer beside the model) refuse in one line instead of using other ids."""
    weights = copy_model(lm_run["model"], tmp_path / "weights")
    texts = write_texts(tmp_path / "train.parquet", corpus(200, 4))
    cfg = lm_config(tmp_path, weights, "text", rows=16, length=16,
                    data={"train_path": str(texts), "train_targets_path": None},
                    training={"max_steps": 2, "per_device_train_batch_size": 2},
                    checkpoint={"every_steps": 2}, parallel={"nodes": 1, "procs_per_node": 1})
    res = cli("train", "--config", write_config(tmp_path / "text.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "text"
    prompts = write_texts(tmp_path / "prompts.jsonl", ["the cluster trains"])
    config = json.loads((weights / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77  # any change to the tokenizer's files
    (weights / "tokenizer_config.json").write_text(json.dumps(config))
    res = cli("predict", run, "--input", prompts, "--nodes", 1, "--procs-per-node", 1,
              "--gpus-per-node", 0)
    assert "changed since this run tokenized its data" in refused(res, "model.name")
    res = cli("export", run, "--out", tmp_path / "hf", "--format", "hf")
    assert "changed since this run tokenized its data" in refused(res, "model.name")
    assert not (tmp_path / "hf").exists() and list((run / "predictions").iterdir()) == []


def test_export_and_resume_refuse_a_transposed_tensor_by_name(lm_run, tmp_path):
    """The header check prepare makes (test_lm_weight_headers) is made again where a later
    command reads the weights: the weights folder is planted in place and restored after."""
    from safetensors.torch import load_file, save_file

    file = lm_run["model"] / "model.safetensors"
    kept = tmp_path / "kept.safetensors"
    shutil.copy2(file, kept)
    try:
        tensors = load_file(str(file))
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].t().contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
        res = cli("export", lm_run["run"], "--out", tmp_path / "out", "--format", "hf",
                  timeout=120)
        line = refused(res, "model.embed_tokens.weight")
        assert str(file) in line and "needs" in line
        assert not (tmp_path / "out").exists()
        res = cli("resume", lm_run["run"], "--set", "training.max_steps=4", timeout=120)
        refused(res, "model.embed_tokens.weight")
    finally:
        shutil.move(kept, file)


def test_resume_refuses_other_lora_targets_and_keeps_its_config(lm_run):
    """`resume --set lora.target_modules=...` would give the run other adapters than its
    checkpoints hold (test_resume_keeps_model, on the users' bf16 LoRA run): one line, and
    the run's config.yaml is left as it was."""
    config = lm_run["run"] / "config.yaml"
    before = config.read_bytes()
    res = cli("resume", lm_run["run"], "--set", "lora.target_modules=[q_proj,qkv_proj]",
              timeout=120)
    refused(res, "lora.target_modules: the run's checkpoints hold a model of "
                 "lora.target_modules 'attention'")
    assert config.read_bytes() == before


@pytest.mark.parametrize("bad", ["past the vocabulary", "float"])
def test_predict_refuses_token_ids_the_model_cannot_embed(lm_run, tmp_path, bad):
    """An --input of token ids holding one past vocab_size (or floats) is one line before
    anything of the prediction is written (it was an IndexError on every rank)."""
    import numpy as np

    from lm_support import packed_tokens

    vocab = json.loads((lm_run["model"] / "config.json").read_text())["vocab_size"]
    x = packed_tokens(lm_run["model"], 4, 16)
    if bad == "float":
        x = x.astype(np.float32)
    else:
        x[1, 2] = vocab
    np.save(tmp_path / "x.npy", x)
    before = sorted(p.name for p in (lm_run["run"] / "predictions").iterdir())
    res = cli("predict", lm_run["run"], "--input", tmp_path / "x.npy", "--name", "bad",
              "--gpus-per-node", "0", "--procs-per-node", "1", timeout=120)
    refused(res, "--input: input holds " + ("dtype float32, not token ids" if bad == "float"
                                            else f"token id {vocab}, past the model's vocabulary"))
    assert sorted(p.name for p in (lm_run["run"] / "predictions").iterdir()) == before
