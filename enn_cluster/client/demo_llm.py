"""`make demo-llm`: the language-model job on this machine, in a few minutes.

1. a tiny random Qwen2-shaped model and a tokenizer trained on a small corpus, written by
   `save_pretrained` in bf16 into a local directory (what a user brings from Lustre);
2. a parquet file of text (and one for evaluation);
3. LoRA trained on 2 ranks, paused at step 12 of 24, and resumed on 1 (the run keeps its
   global batch and its learning-rate schedule);
4. rows scored and continued (greedy) by the fine-tuned model;
5. `--format hf` exported and loaded back with transformers.

It drives the real CLI in fresh processes (examples/llm_lora.yaml), as a user would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from enn_cluster.storage.metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "llm_lora.yaml"
LOCAL = ("--cluster", "local", "--gpus-per-node", "0", "--nodes", "1")


def _cli(*args: str) -> str:
    cmd = [sys.executable, "-m", "enn_cluster.client.cli", *args]
    print("$ enn-submit " + " ".join(args), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(done.returncode)
    return done.stdout.strip()


def make_assets(root: Path) -> tuple[Path, Path, Path]:
    """The model directory and the train/eval parquet files under `root`."""
    from enn_cluster.client.llm_assets import corpus, write_texts, write_tiny_model

    model = write_tiny_model(root / "tiny-qwen2", "qwen2", texts=corpus(600, 11),
                             dtype="bfloat16")  # as every Qwen2.5 checkpoint is saved
    train = write_texts(root / "train.parquet", corpus(800, 1))
    evals = write_texts(root / "eval.parquet", corpus(64, 2))
    return model, train, evals


def main() -> None:
    started = time.perf_counter()
    runs_root = Path(os.environ.get("ENN_DEMO_RUNS", "demo-runs")).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model, train, evals = make_assets(runs_root / f"llm-assets-{stamp}")
    run = runs_root / f"llm-{stamp}"
    sets = ("--set", f"model.name=hf:{model}", "--set", f"data.train_path={train}",
            "--set", f"data.eval_path={evals}")
    _cli("train", "--config", str(CONFIG), "--run-name", run.name, "--runs-root", str(runs_root),
         *sets, "--set", "training.max_steps=24", "--set", "training.pause_at_step=12",
         "--set", "training.lr=0.01", *LOCAL, "--procs-per-node", "2")
    _cli("resume", str(run), *LOCAL, "--procs-per-node", "1")  # on to step 24, same schedule
    _cli("status", str(run))
    prompts = runs_root / f"llm-assets-{stamp}" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                               ("the cluster trains", "checkpoints land on the shared",
                                "the loss goes down as")))
    _cli("predict", str(run), "--input", str(prompts), "--name", "scores", *LOCAL,
         "--procs-per-node", "2")
    _cli("predict", str(run), "--input", str(prompts), "--name", "continued", "--generate", "8",
         *LOCAL, "--procs-per-node", "2")
    for name in ("scores", "continued"):
        _cli("collect", str(run), "--name", name, "--out", str(run / f"{name}.npy"))
    export = run / "export-hf"
    _cli("export", str(run), "--out", str(export), "--format", "hf")
    _report(run, export)
    print(f"demo-llm finished in {time.perf_counter() - started:.1f} s")


def _report(run: Path, export: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = list(read_metrics(run / "metrics.jsonl", "train"))
    evals = list(read_metrics(run / "metrics.jsonl", "eval"))
    print(f"\nloss: first step {train[0]['loss']:.4f}, last step {train[-1]['loss']:.4f}"
          + (f"; eval loss {evals[-1]['eval_loss']:.4f}" if evals else ""))
    tok = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    scores, made = np.load(run / "scores.npy"), np.load(run / "continued.npy")
    for (mean, n), ids in zip(scores, made):
        text = tok.decode([int(i) for i in ids if i >= 0])
        print(f"  mean log-likelihood {mean:.3f} over {int(n)} tokens; continued: {text!r}")
    model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    ids = tok("the cluster trains", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    print(f"transformers loads the export ({export}); it continues 'the cluster trains' "
          f"with {tok.decode(out)!r}")


if __name__ == "__main__":
    main()
