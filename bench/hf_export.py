"""Peak memory of `export --format hf` (streamed, client/hf_stream.py) against the model it
writes, and against the whole-model export it replaced, measured in the same run.

A random Llama saved in bf16 (hidden 1024, 8 layers: 91 M parameters, 182 MB in bf16) is
trained one step on one rank, fully and with LoRA, so that the export reads every weight
from the DCP checkpoint (fp32 master weights) in the first case and merges adapters into
the bf16 base in the second. Each side runs in a fresh interpreter with
MALLOC_MMAP_THRESHOLD_=1 MiB (freed tensors go back to the system, as in tests/peak_rss.py):
one untimed export pages in the code, then the peak RSS of a second one over what was
resident before it (VmHWM after clear_refs). Ours: `export_run(format="hf")` with shards of
an eighth of the model (a 70B model's 5 GB shards are a 28th of it). Baseline: what the
export did before, `Run.load_model()` (the whole fp32 model, LoRA merged) and
`save_pretrained`. The figure is ours' peak over the bytes ours wrote: about one shard's
fp32 read group plus one tensor, not the model.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from .measure import BenchContext, Result, Series, ratios

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4)
QUICK = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)
MODES = ("full", "lora")


def _rss(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def probe(side: str, run: str, out: str, shard_mb: float) -> None:
    """In a fresh interpreter: print {"peak_mb"}, the second export's peak RSS over the RSS
    before it."""
    import gc

    import peft  # noqa: F401  (both sides' imports resident before the measured export)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from enn_cluster import Run
    from enn_cluster.client.artifact_export import export_run

    def export(dest: Path) -> None:
        if side == "ours":
            export_run(run, dest, fmt="hf", max_shard_mb=shard_mb)
        else:
            dest.mkdir()
            Run.open(run).load_model().lm.save_pretrained(str(dest))

    warm = Path(out + "-warm")
    export(warm)
    shutil.rmtree(warm)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:  # restart the peak-RSS count here
        fh.write("5")
    before = _rss("VmHWM")
    export(Path(out))
    print(json.dumps({"peak_mb": _rss("VmHWM") - before}))


def _peak(ctx: BenchContext, side: str, run: Path, out: Path, shard_mb: float) -> float:
    code = f"from bench.hf_export import probe; probe({side!r}, {str(run)!r}, {str(out)!r}, {shard_mb!r})"
    res = subprocess.run([ctx.python, "-c", code], capture_output=True, text=True, timeout=900,
                         cwd=str(ctx.root),
                         env=ctx.subprocess_env(MALLOC_MMAP_THRESHOLD_=1 << 20))
    if res.returncode != 0:
        raise RuntimeError(f"{side} export exited {res.returncode}: {res.stderr[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"]


def _train(ctx: BenchContext, base: Path, model_dir: Path, mode: str) -> Path:
    import numpy as np

    ids = base / "ids.npy"
    if not ids.exists():
        np.save(ids, np.random.default_rng(0).integers(0, 400, (8, 32)).astype(np.int32))
    cfg = {"run_name": mode, "runs_root": str(base / "runs"), "model": {"name": f"hf:{model_dir}"},
           "lora": {"r": 0} if mode == "full" else {"r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train_path": str(ids), "train_targets_path": str(ids), "max_length": 32,
                    "eval_fraction": 0.0},
           "training": {"max_steps": 1, "per_device_train_batch_size": 1, "lr": 1e-3},
           "checkpoint": {"every_steps": 1}, "parallel": {"nodes": 1, "procs_per_node": 1}}
    path = base / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(path)], capture_output=True, text=True,
                         env=ctx.subprocess_env(), timeout=900, cwd=str(ctx.root))
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    return base / "runs" / mode


def run(ctx: BenchContext) -> list[Result]:
    from enn_cluster.client import llm_assets

    base = ctx.workdir / "hf_export"
    base.mkdir(parents=True, exist_ok=True)
    shape = QUICK if ctx.quick else MODEL
    model_dir = llm_assets.write_tiny_model(base / "model", "llama", dtype="bfloat16", **shape)
    model_mb = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e6
    shard_mb = round(model_mb / 8, 3)
    repeats = 1 if ctx.quick else min(ctx.repeats, 3)
    out = []
    for mode in MODES:
        run_dir = _train(ctx, base, model_dir, mode)
        ctx.log(f"hf_export ({mode}): {model_mb:.0f} MB bf16 model, shards of {shard_mb} MB, "
                f"{repeats} repeats")
        ours, whole, written = [], [], []
        for i in range(repeats):
            for side in (("ours", "whole") if i % 2 == 0 else ("whole", "ours")):
                dest = base / f"{mode}-{side}-{i}"
                peak = _peak(ctx, side, run_dir, dest, shard_mb)
                (ours if side == "ours" else whole).append(peak)
                if side == "ours":
                    written.append(sum(p.stat().st_size for p in dest.glob("*.safetensors")) / 1e6)
                shutil.rmtree(dest)
        out.append(Result(
            "hf_export", f"export --format hf peak RSS / model size ({mode})", "<=", 0.5,
            samples=ratios(ours, written),
            ours=Series("export --format hf, streamed (peak RSS over resident, MB)", "MB", ours),
            baseline=Series("Run.load_model() + save_pretrained, the whole-model export before "
                            "(peak RSS over resident, MB)", "MB", whole),
            note=(f"random Llama hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
                  f"layers, saved in bf16 ({model_mb:.0f} MB), one step of "
                  f"{'full fine-tuning' if mode == 'full' else 'LoRA r=8'} on 1 rank; ours "
                  f"writes bf16 shards of {shard_mb} MB; the whole-model export's peak / model "
                  f"size: {sum(whole) / len(whole) / model_mb:.2f}")))
    return out


if __name__ == "__main__":  # python -m bench.hf_export: the figures alone
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        context = BenchContext(quick="--quick" in sys.argv, workdir=Path(tmp),
                               root=Path(__file__).resolve().parents[1], python=sys.executable,
                               repeats=1)
        for result in run(context):
            print(result.name, result.samples, result.note)
