"""Shared pieces of the language-model tests: a tiny real model written by save_pretrained,
token rows made with its own tokenizer, and run configs around them."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from enn_cluster.client.llm_assets import corpus, write_texts, write_tiny_model
from helpers import with_sections


def tiny_model(root: Path, arch: str = "llama", **shape) -> Path:
    """A tiny model + tokenizer under `root` (made once per root and arch)."""
    path = root / f"tiny-{arch}"
    if not (path / "config.json").exists():
        write_tiny_model(path, arch, **shape)
    return path


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def packed_tokens(model_dir: Path, rows: int, length: int, seed: int = 3) -> np.ndarray:
    """`rows` x `length` token ids: the corpus encoded by the model's own tokenizer, each
    document followed by EOS, cut into rows (what packed staging makes)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids: list[int] = []
    for text in corpus(rows * length // 4 + 50, seed):
        ids += tok(text).input_ids + [tok.eos_token_id]
        if len(ids) >= rows * length:
            break
    assert len(ids) >= rows * length
    return np.array(ids[:rows * length], np.int32).reshape(rows, length)


def token_files(tmp: Path, model_dir: Path, rows: int, length: int) -> tuple[Path, Path]:
    x = packed_tokens(model_dir, rows, length)
    np.save(tmp / "ids.npy", x)
    np.save(tmp / "labels.npy", x)
    return tmp / "ids.npy", tmp / "labels.npy"


def lm_config(tmp: Path, model_dir: Path, name: str, rows: int = 64, length: int = 32,
              **over) -> dict:
    x, y = token_files(tmp, model_dir, rows, length)
    cfg = {
        "run_name": name, "runs_root": str(tmp / "runs"),
        "model": {"name": f"hf:{model_dir}"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"train_path": str(x), "train_targets_path": str(y), "max_length": length},
        "training": {"epochs": 2, "per_device_train_batch_size": 2, "lr": 3e-3,
                     "warmup_ratio": 0.1, "seed": 5},
        "checkpoint": {"every_steps": 4, "keep_last": 5},
        "parallel": {"nodes": 1, "procs_per_node": 2},
    }
    return with_sections(cfg, over)


def hf_loss(model_dir: Path, ids: np.ndarray, labels: np.ndarray) -> float:
    """transformers' own loss of its own from_pretrained model on these rows."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.from_numpy(ids).long(),
                           labels=torch.from_numpy(labels).long()).loss)


__all__ = ["tiny_model", "copy_model", "packed_tokens", "token_files", "lm_config", "hf_loss",
           "write_texts", "corpus"]
