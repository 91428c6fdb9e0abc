"""GPU throughput of what users run: tokens/s and MFU of `enn-submit train` on a
Llama-shaped model (`model.name: hf:DIR`, full fine-tune, bf16 under FSDP2's mixed
precision, sharded per decoder layer), on every GPU of the node, read from the run's
metrics.jsonl.

The model is a random Llama of the public Llama-3.2-1B shape (hidden 2048, 16 layers, 32
heads, 8 KV heads, MLP 8192: 0.97 B non-embedding parameters) written locally with
`save_pretrained` (llm_assets.write_tiny_model with that shape; its tokenizer is the small
BPE one, so the embedding and the LM head are small and not counted). Tokens/s = global
batch x sequence length x steps/s from the end-of-step stamps of metrics.jsonl, after
`WARMUP` steps. MFU = tokens/s x FLOPs per token / (GPUs x peak): FLOPs per token = 6 N
(forward + backward over the N non-embedding parameters) + 12 L d s (attention scores and
values; PaLM, Chowdhery et al. 2022, appendix B). Peak dense bf16 per GPU from the vendor
data sheets (PEAK_TFLOPS); on a GPU not in the table MFU is reported unknown (tokens/s still
measured) unless ENN_GPU_PEAK_TFLOPS gives the peak. Published anchor: torchtitan,
Llama-3.1-8B, 8 x H100, FSDP, bf16: 33-39 % MFU. Skips (a result, not an error) without
CUDA; `measure` runs the same path on the CPU with a tiny shape (the smoke test).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .measure import BenchContext, Result, Series

WARMUP = 3  # steps left out of the rate

# Dense bf16 tensor-core TFLOP/s (the data sheets print twice these, "with sparsity"),
# matched in order against torch.cuda.get_device_name, case-insensitively: the PCIe and
# NVL boards before the bare name, which is the SXM part's ("NVIDIA H100 80GB HBM3").
# H100 SXM 989 / PCIe 756 / NVL 835: NVIDIA H100 Tensor Core GPU data sheet; H200 SXM 989 /
# NVL 835: NVIDIA H200 data sheet (GH200 matches H200: the same 989); A100 312 (SXM and
# PCIe alike): NVIDIA A100 data sheet.
PEAK_TFLOPS = (("H100 PCIE", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
               ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    seq: int = 2048
    batch: int = 4  # sequences per GPU per step

    def hf(self) -> dict:
        """The config.json fields (llm_assets.write_tiny_model's shape overrides)."""
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    intermediate_size=self.intermediate, max_position_embeddings=self.seq)

    def params(self) -> int:
        """Non-embedding parameters: per layer q/o (d^2 each), k/v (d x kv width each), the
        gated MLP (3 d i) and two RMSNorms (2 d); then the final norm (the 6N of MFU)."""
        d, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        return self.layers * (2 * d * d + 2 * d * kv + 3 * d * self.intermediate + 2 * d) + d

    def flops_per_token(self) -> float:
        return 6.0 * self.params() + 12.0 * self.layers * self.hidden * self.seq


TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seq=32, batch=2)


def peak_tflops(device_name: str, environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """The GPU's dense bf16 peak: ENN_GPU_PEAK_TFLOPS, else the first PEAK_TFLOPS entry
    in the device name; None when unknown (MFU is then reported unknown, not guessed)."""
    if environ.get("ENN_GPU_PEAK_TFLOPS"):
        return float(environ["ENN_GPU_PEAK_TFLOPS"])
    name = device_name.upper()
    return next((value for key, value in PEAK_TFLOPS if key in name), None)


def measure(ctx: BenchContext, shape: Shape, gpus: int, steps: int, repeats: int) -> list:
    """Tokens/s of `enn-submit train` (1 node, one process per GPU; 2 CPU processes when
    `gpus` is 0) on a random Llama of `shape`, once per repeat."""
    from enn_cluster.client import llm_assets

    from .lm_overhead import ours
    from .overhead import steps_per_s

    procs = gpus or 2
    base = ctx.workdir / "gpu"
    model_dir = llm_assets.write_tiny_model(base / "model", "llama", **shape.hf())
    rows = procs * shape.batch * (steps + WARMUP)
    train = llm_assets.write_texts(base / "train.parquet",  # >= 20 tokens a document
                                   llm_assets.corpus(rows * shape.seq // 20 + 100, seed=4))
    tokens = procs * shape.batch * shape.seq  # per optimizer step (packed rows)
    rates = []
    for i in range(repeats):
        cfg = {"run_name": f"gpu-{i}", "runs_root": str(base / "runs"),
               "model": {"name": f"hf:{model_dir}"},
               "data": {"train_path": str(train), "max_length": shape.seq, "packing": True,
                        "eval_fraction": 0.0},
               "training": {"max_steps": steps + WARMUP, "per_device_train_batch_size":
                            shape.batch, "lr": 1e-5, "bf16": "auto"},
               "logging": {"every_steps": 1}, "checkpoint": {"every_steps": 0, "keep_last": 1},
               "parallel": {"strategy": "fsdp", "nodes": 1, "procs_per_node": procs}}
        recs = ours(ctx, cfg, "--nodes", "1", "--procs-per-node", str(procs),
                    "--gpus-per-node", str(gpus))
        rates.append(tokens * steps_per_s([r["time"] for r in recs], WARMUP))
    return rates


def run(ctx: BenchContext, shape: Optional[Shape] = None) -> list[Result]:
    """`shape`: the model measured (default the ~1B Llama; the tests pass a tiny one)."""
    import torch

    name = "GPU tokens/s and MFU, enn-submit train, ~1B Llama, FSDP2 on the node's GPUs, bf16"
    if not torch.cuda.is_available():
        return [Result("gpu", name, skipped="skipped: no CUDA device on this machine "
                                            "(GPU figures: bench/results-gpu.md)")]
    world, shape = torch.cuda.device_count(), shape or Shape()
    device_name = torch.cuda.get_device_name(0)
    peak = peak_tflops(device_name)
    rates = measure(ctx, shape, world, 5 if ctx.quick else 20, ctx.repeats)
    mfu = ([rate * shape.flops_per_token() / (world * peak * 1e12) for rate in rates]
           if peak is not None else [])
    peak_text = (f"peak {peak:.0f} TFLOP/s each; samples are MFU (fraction of peak)"
                 if peak is not None else
                 "MFU unknown: no peak known for this GPU (set ENN_GPU_PEAK_TFLOPS)")
    return [Result("gpu", name, samples=mfu,
                   ours=Series("tokens/s (all GPUs), from metrics.jsonl", "tokens/s", rates),
                   note=f"{shape.params() / 1e9:.2f} B non-embedding parameters, seq "
                        f"{shape.seq}, {shape.batch} sequences per GPU, {world} x "
                        f"{device_name}, {peak_text}")]
