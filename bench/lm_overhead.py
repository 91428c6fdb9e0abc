"""Runtime overhead on the language-model path: tokens/s of `enn-submit train` on a tiny
Llama (`model.name: hf:DIR`, full fine-tune) vs a bare FSDP2 + transformers loop
(bench/bare_lm_loop.py) doing the same work.

Both run 4 CPU processes on a 2x2 HSDP mesh, load the same weights directory (written once
by `llm_assets.write_tiny_model`), shard per decoder layer then the root, train on the same
staged token rows in the same order (the bare loop reads memmaps that
`text_staging.stage_text_data` wrote from the same parquet, with the same config), with the
same micro-batch, accumulation, clip, fused AdamW and a loss read every step (ours logs
every step). Tokens/s comes from the wall-clock stamps at the end of each step (ours: the
`time` of metrics.jsonl train records), over the steps after the first `skip`; tokens per
step = global batch x max_length (packed rows: every position is a token). The two sides
alternate, `pairs` times.

Full fine-tune rather than LoRA: every parameter's gradient then goes through the
reduce-scatter, the clip, the non-finite counts and AdamW, where our per-step extras cost
the most; under LoRA they cover the adapters only.

Two precisions, each its own figure: fp32, and bf16 as users run it (the weights saved in
bf16, as every Llama-3 config says; fp32 master weights and bf16 compute through FSDP2's
MixedPrecisionPolicy on both sides; bf16 runs on the CPU here).
"""
from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import yaml

from .group import run_group
from .measure import BenchContext, Result, Series, alternating, ratios
from .overhead import SHAPE, steps_per_s

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4)


def sizes(ctx: BenchContext, precision: str = "fp32") -> dict:
    """bf16 runs on this machine's CPUs about 7x slower than fp32 (no native bf16 matmul):
    its figure uses a quarter of the tokens per step, fewer steps and 3 pairs, so that it
    costs about what the fp32 one does."""
    if precision == "bf16":
        return {"seq": 64, "micro": 2, "accum": 1, "docs": 4000, "lr": 1e-4, "seed": 0,
                "steps": 8 if ctx.quick else 14, "skip": 3 if ctx.quick else 4,
                "pairs": 1 if ctx.quick else 3}
    return {"seq": 128, "micro": 2, "accum": 2, "docs": 4000, "lr": 1e-4, "seed": 0,
            "steps": 12 if ctx.quick else 40, "skip": 4 if ctx.quick else 8,
            "pairs": 1 if ctx.quick else max(ctx.repeats, 3)}


PRECISIONS = ("fp32", "bf16")


def run_config(ctx: BenchContext, name: str, s: dict, model_dir: Path, train: Path,
               precision: str = "fp32") -> dict:
    """The `enn-submit train` config of ours (its data section stages the bare loop's rows too)."""
    return {"run_name": name, "runs_root": str(ctx.workdir / "runs"),
            "model": {"name": f"hf:{model_dir}"},
            "data": {"train_path": str(train), "text_field": "text", "max_length": s["seq"],
                     "packing": True, "eval_fraction": 0.0},
            "lora": {"r": 0},
            "training": {"max_steps": s["steps"], "per_device_train_batch_size": s["micro"],
                         "gradient_accumulation_steps": s["accum"], "lr": s["lr"],
                         "weight_decay": 0.0, "grad_clip": 1.0, "seed": s["seed"],
                         "warmup_ratio": 0.0,
                         "bf16": "true" if precision == "bf16" else "false"},
            "logging": {"every_steps": 1},
            "checkpoint": {"every_steps": 0, "keep_last": 1},
            "parallel": {"strategy": "hsdp", **SHAPE}}


def assets(ctx: BenchContext, s: dict, precision: str) -> tuple[Path, Path, Path]:
    """The weights directory (saved in `precision`'s dtype: the same random weights either
    way), the parquet of text, and the bare loop's staged rows (`s`'s sequence length)."""
    from enn_cluster.client import llm_assets
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.storage.text_staging import stage_text_data

    base = ctx.workdir / "lm_overhead" / precision
    base.mkdir(parents=True, exist_ok=True)
    model_dir = llm_assets.write_tiny_model(
        base / "model", "llama", seed=s["seed"], max_position_embeddings=s["seq"] * 4,
        dtype="bfloat16" if precision == "bf16" else "float32", **MODEL)
    train = llm_assets.write_texts(base / "train.parquet", llm_assets.corpus(s["docs"], seed=3))
    staged = base / "bare-data"
    staged.mkdir(exist_ok=True)
    cfg = config_from_dict(run_config(ctx, "staging", s, model_dir, train, precision))
    manifest = stage_text_data(cfg.data, cfg.model, staged)
    need = s["micro"] * s["accum"] * SHAPE["nodes"] * SHAPE["procs_per_node"] * s["steps"]
    if manifest["text"]["rows"] < need:
        raise RuntimeError(f"lm_overhead: {manifest['text']['rows']} rows staged, {need} needed")
    return model_dir, train, staged


def ours(ctx: BenchContext, cfg: dict, *flags: str) -> list[dict]:
    """Run `enn-submit train` on `cfg` (written beside its runs folder) with `flags`; its
    metrics.jsonl train records."""
    path = Path(cfg["runs_root"]).parent / f"{cfg['run_name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(path), *flags], capture_output=True, text=True,
                         env=ctx.subprocess_env(), timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    metrics = Path(cfg["runs_root"]) / cfg["run_name"] / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"]


def run(ctx: BenchContext) -> list[Result]:
    out = []
    for precision in PRECISIONS:
        s = sizes(ctx, precision)
        out.append(measure(ctx, s, precision, *assets(ctx, s, precision)))
    return out


def measure(ctx: BenchContext, s: dict, precision: str, model_dir: Path, train: Path,
            staged: Path) -> Result:
    world = SHAPE["nodes"] * SHAPE["procs_per_node"]
    tokens = s["micro"] * s["accum"] * world * s["seq"]  # per optimizer step
    ctx.log(f"lm_overhead ({precision}): {s['pairs']} pairs of 4-process runs, {s['steps']} "
            f"steps of {tokens} tokens")
    enn, bare, inner = [], [], []
    for i, side in alternating(s["pairs"]):
        if side == "ours":
            recs = ours(ctx, run_config(ctx, f"lm-overhead-{precision}-{i}", s, model_dir,
                                        train, precision))
            enn.append(tokens * steps_per_s([r["time"] for r in recs], s["skip"]))
            inner.append(statistics.median(r["step_time_s"] for r in recs[s["skip"]:]))
        else:
            from .bare_lm_loop import train as bare_train

            out = run_group(bare_train, world, str(model_dir), str(staged), SHAPE["nodes"],
                            SHAPE["procs_per_node"], s["micro"], s["accum"], s["steps"],
                            s["lr"], s["seed"], precision == "bf16")
            bare.append(tokens * steps_per_s(out[0], s["skip"]))
    m = MODEL
    name = "lm_overhead" if precision == "fp32" else f"lm_overhead_{precision}"
    return Result(
        name, f"LM runtime overhead ({precision}): tokens/s vs bare FSDP2 + transformers loop",
        ">=", 0.95, samples=ratios(enn, bare),
        ours=Series("enn-submit train (hf:DIR, full fine-tune), tokens/s from metrics.jsonl "
                    "stamps", "tokens/s", enn),
        baseline=Series("FSDP2 + transformers loop (bench/bare_lm_loop.py)", "tokens/s", bare),
        note=(f"4 CPU processes, 2x2 HSDP, random Llama hidden {m['hidden_size']}, "
              f"{m['num_hidden_layers']} layers, seq {s['seq']}, micro-batch {s['micro']} x "
              f"{s['accum']} accumulation per rank ({tokens} tokens/step), {precision}"
              f"{' (weights saved in bf16, fp32 master weights)' if precision == 'bf16' else ''}, "
              f"{s['steps']} steps, first {s['skip']} excluded; enn's own step_time_s median "
              f"{statistics.median(inner) * 1e3:.0f} ms"))
