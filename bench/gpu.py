"""GPU throughput: tokens/s and MFU of a ~1B-parameter decoder under FSDP2 (1 GPU) or
HSDP (every GPU of the node, mesh replicate x shard = 1 x N), bf16 parameters, fp32
reductions, as enn_cluster's parallel.wrap_model shards it (block by block, then the root).

MFU = achieved model FLOPs / peak: FLOPs per token = 6 N (forward + backward over the
N non-embedding parameters) + 12 L d s (attention scores and values; PaLM, Chowdhery et al.
2022, appendix B). Peak dense bf16 per GPU from the vendor data sheets (PEAK_TFLOPS); on a
GPU not in the table MFU is reported unknown (tokens/s still measured) unless
ENN_GPU_PEAK_TFLOPS gives the peak. Published anchor: torchtitan, Llama-3.1-8B, 8 x H100,
FSDP, bf16: 33-39 % MFU. Skips (a result, not an error) without CUDA.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from .measure import BenchContext, Result, Series

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
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4  # sequences per GPU per step

    def block_params(self) -> int:
        """Attention (4 d^2 + 4 d) + MLP 4x (8 d^2 + 5 d) + two LayerNorms (4 d)."""
        d = self.dim
        return 12 * d * d + 13 * d

    def params(self) -> int:
        """Non-embedding parameters: blocks and the final norm (the 6N of the MFU formula)."""
        return self.layers * self.block_params() + 2 * self.dim

    def flops_per_token(self) -> float:
        return 6.0 * self.params() + 12.0 * self.layers * self.dim * self.seq


def build(shape: Shape):
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = shape.dim
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, shape.heads, d // shape.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
            return x + self.down(F.gelu(self.up(self.n2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(shape.vocab, shape.dim)
            self.layers = nn.ModuleList(Block() for _ in range(shape.layers))
            self.norm = nn.LayerNorm(shape.dim)
            self.head = nn.Linear(shape.dim, shape.vocab, bias=False)

        def blocks(self):
            return list(self.layers)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return Decoder()


def peak_tflops(device_name: str, environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """The GPU's dense bf16 peak: ENN_GPU_PEAK_TFLOPS, else the first PEAK_TFLOPS entry
    in the device name; None when unknown (MFU is then reported unknown, not guessed)."""
    if environ.get("ENN_GPU_PEAK_TFLOPS"):
        return float(environ["ENN_GPU_PEAK_TFLOPS"])
    name = device_name.upper()
    return next((value for key, value in PEAK_TFLOPS if key in name), None)


def _rank(rank: int, world: int, port: int, shape: Shape, steps: int, out: str) -> None:
    """One GPU's worker: FSDP2/HSDP over the node's GPUs, timed steps after warm-up."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.worker.parallel import build_mesh, wrap_model

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    plan = MeshPlan("hsdp" if world > 1 else "fsdp", 1, world)
    with torch.device("meta"):
        model = build(shape)
    model = wrap_model(model, plan, build_mesh(plan, device), device, use_bf16=True)
    model.to_empty(device=device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=device)
    timed = 0.0
    for step in range(steps + 3):  # 3 warm-up steps
        torch.cuda.synchronize()
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        timed += (time.perf_counter() - started) if step >= 3 else 0.0
    if rank == 0:
        with open(out, "w") as fh:
            fh.write(f"{steps * shape.batch * shape.seq * world / timed}\n")
    dist.destroy_process_group()


def run(ctx: BenchContext, shape: Optional[Shape] = None) -> list[Result]:
    """`shape`: the model measured (default the ~1B decoder; the tests pass a tiny one)."""
    import torch

    name = "GPU tokens/s and MFU, ~1B decoder, FSDP2 (1 GPU) / HSDP (node), bf16"
    if not torch.cuda.is_available():
        return [Result("gpu", name, skipped="skipped: no CUDA device on this machine")]
    import socket

    import torch.multiprocessing as mp

    world, shape = torch.cuda.device_count(), shape or Shape()
    device_name = torch.cuda.get_device_name(0)
    steps = 5 if ctx.quick else 20
    peak = peak_tflops(device_name)
    tokens = Series("tokens/s (all GPUs)", "tokens/s")
    mfu = []
    for i in range(ctx.repeats):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.workdir / f"gpu-{i}.txt"
        mp.spawn(_rank, args=(world, port, shape, steps, str(out)), nprocs=world, join=True)
        rate = float(out.read_text())
        tokens.values.append(rate)
        if peak is not None:
            mfu.append(rate * shape.flops_per_token() / (world * peak * 1e12))
    peak_text = (f"peak {peak:.0f} TFLOP/s each; samples are MFU (fraction of peak)"
                 if peak is not None else
                 "MFU unknown: no peak known for this GPU (set ENN_GPU_PEAK_TFLOPS)")
    return [Result("gpu", name, samples=mfu, ours=tokens,
                   note=f"{shape.params() / 1e9:.2f} B non-embedding parameters, {world} x "
                        f"{device_name}, {peak_text}")]
