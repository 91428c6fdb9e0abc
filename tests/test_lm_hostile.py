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
from pathlib import Path

import pytest

from helpers import cli, write_config
from lm_support import bf16_training, lm_config, tiny_model

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


def _refused(res, field: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], res.stderr[-3000:]
    return lines[0]


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
    _refused(res, "step-2")
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
        _refused(res, "model.name")
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
