"""The device check's in-process checks (bench/device_check.sh, step `micro`): the paths a
GPU takes that the trainer's CPU runs reach in another form. Placement on the node's real
PCI/NUMA sysfs, the fabric and memlock checks, the accelerator lane, fused AdamW's
`found_inf` skip on FSDP2 DTensors, torch.compile with the composable activation
checkpoint, flash SDPA. With no CUDA the same package calls run over gloo on the CPU and the
CUDA-only readings print as INFO: tests/repo/test_gpu_check_script.py runs it so, and this file
cannot drift from the package's API unseen (the copy in ../shared did: its optimizer stand-in
lacked the Adam fields new_optimizer reads).

    OUT=DIR python -m bench.device_micro      # one PASS/FAIL/INFO line per check, DIR/micro.json
    python -m bench.device_micro assets DIR   # DIR/model (a Llama saved in bf16), texts, prompts
    python -m bench.device_micro inspect RUN [lora|float8]   # what a run kept
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS: dict[str, str] = {}


def line(key: str, ok, msg: str = "") -> None:
    """ok True/False prints PASS/FAIL; None prints INFO (a reading, not a verdict)."""
    RESULTS[key] = msg
    word = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    print(f"{word} {key}" + (f" {msg}" if msg else ""), flush=True)


def node_checks(env, dev) -> None:
    from enn_cluster.config.nccl import detect_fabric, memlock_problem
    from enn_cluster.worker.entry import memlock_limit
    from enn_cluster.worker.placement import cuda_bus_ids, pci_numa_node, place_task

    try:
        placed = place_task(env, dev)
        bus = cuda_bus_ids()
        numa = [pci_numa_node(b) for b in bus]
        # every visible GPU's address must name a sysfs device (pci_domain_id on a GPU build)
        seen = all(os.path.isdir(f"/sys/bus/pci/devices/{b}") for b in bus)
        line("placement", seen, f"{placed.line()} bus={bus} numa={numa}")
    except Exception as exc:  # the check reports; the script goes on
        line("placement", False, repr(exc))
    fabric, limit = detect_fabric(environ=os.environ), memlock_limit()
    problem = memlock_problem(fabric, limit)
    line("fabric_memlock", problem is None,
         f"fabric={fabric} ulimit -l={'unlimited' if limit is None else limit}"
         + (f" refused: {problem}" if problem else ""))


def fused_adamw_skip(dev) -> None:
    """found_inf=1 must leave every parameter untouched, found_inf=0 must move them: the
    trainer's non-finite guard, which never reads the flag back to the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from enn_cluster.config.run_config import TrainingConfig
    from enn_cluster.worker.step_math import StepNorm, new_optimizer

    mesh = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).to(dev)
    for block in m:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(m, mesh=mesh, mp_policy=policy)
    opt = new_optimizer(list(m.parameters()), TrainingConfig(lr=1e-2, weight_decay=0.0))
    m(torch.randn(8, 256, device=dev)).float().pow(2).mean().backward()
    norm = StepNorm(list(m.parameters()), dev, 1)
    gn, _ = norm.reduce(norm.shard_norms(), torch.zeros((), device=dev), 1.0)
    before = [p.detach().to_local().clone() for p in m.parameters()]
    opt.found_inf = torch.ones((), device=dev)
    opt.step()
    same = all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, m.parameters()))
    opt.found_inf = torch.zeros((), device=dev)
    opt.step()
    moved = any(not torch.equal(a, p.detach().to_local()) for a, p in zip(before, m.parameters()))
    line("fused_adamw_found_inf", same and moved,
         f"skip_kept_params={same} step_moved={moved} grad_norm={float(gn):.4f} "
         f"param_dtype={next(m.parameters()).dtype}")


def compile_and_checkpointing(dev, compile_blocks: bool, small: bool) -> None:
    """A Llama's gradients with compile + full activation checkpointing against eager with
    none, and (on CUDA) the memory the checkpointing saves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from enn_cluster.models.causal_lm import decoder_layers
    from enn_cluster.worker.parallel import prepare_blocks

    width = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4) if small else \
        dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8)
    cfg = AutoConfig.for_model("llama", vocab_size=4096, num_hidden_layers=4,
                               num_key_value_heads=2 if small else 4, **width)
    ids = torch.randint(0, 4096, (2, 64 if small else 1024), device=dev)
    cuda = dev.type == "cuda"

    def run(checkpointing: str, comp: bool):
        torch.manual_seed(0)
        mod = AutoModelForCausalLM.from_config(cfg).to(dev, torch.bfloat16)
        prepare_blocks(decoder_layers(mod), checkpointing, comp)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t = time.time()
        mod(input_ids=ids, use_cache=False).logits.float().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        return [p.grad.float() for p in mod.parameters()], peak, time.time() - t

    g_eager, mem_none, _ = run("none", False)
    g_comp, mem_ac, t_first = run("full", compile_blocks)
    diff = max(((a - b).abs().max() / (a.abs().max() + 1e-6)).item()
               for a, b in zip(g_eager, g_comp))
    line("compile_ac_grads", diff < 5e-2,
         f"max rel grad diff {diff:.3g} (bf16), compile={compile_blocks}, first step {t_first:.1f}s")
    if cuda:
        line("compile_ac_memory", mem_ac < 0.8 * mem_none,
             f"peak extra MB: eager no-AC {mem_none / 1e6:.0f}, full AC {mem_ac / 1e6:.0f}")
        line("sdpa_flash_enabled", torch.backends.cuda.flash_sdp_enabled(),
             f"flash={torch.backends.cuda.flash_sdp_enabled()} "
             f"cudnn={torch.backends.cuda.cudnn_sdp_enabled()}")


def write_assets(work: Path) -> None:
    """A ~60M Llama (tiny with DC_SMALL) saved in bfloat16, as every real checkpoint's
    config.json says, with a 2048-token vocabulary (ids bf16 would round), the texts and
    16 prompts."""
    from transformers import AutoModelForCausalLM

    from enn_cluster.client import llm_assets as A

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2) if os.environ.get("DC_SMALL")
             else dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4))
    model = A.write_tiny_model(work / "model", "llama", vocab_size=2048,
                               max_position_embeddings=512, **shape)
    AutoModelForCausalLM.from_pretrained(str(model)).to(torch.bfloat16).save_pretrained(str(model))
    A.write_texts(work / "train.parquet", A.corpus(6000, seed=1))
    A.write_texts(work / "eval.parquet", A.corpus(200, seed=2))
    (work / "prompts.jsonl").write_text("".join(
        json.dumps({"text": t}) + "\n" for t in ["the cluster trains", "checkpoints land on"] * 8))
    print("assets ok", model)


def inspect_run(run: Path, name: str = "full") -> None:
    """Losses finite, saves asynchronous on a GPU, the lanes the backend report names, and
    the newest checkpoint's dtypes: every tensor fp32 (masters and Adam moments, whatever
    the weights' dtype); with LoRA only adapter tensors. `name`: full, lora or float8 (a
    full fine-tune in float8), the prefix of the lines."""
    from torch.distributed.checkpoint import FileSystemReader

    cuda = torch.cuda.is_available() and os.environ.get("DC_GPUS", "1") != "0"
    lora = name == "lora"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train" and "loss" in r]
    ok = bool(train) and all(math.isfinite(r["loss"]) for r in train)
    line(f"{name}_losses", ok, " ".join(f"{r['step']}:{r['loss']:.3f}" for r in train))
    flags = [r.get("async_save") for r in recs if r["kind"] == "checkpoint"]
    line(f"{name}_async_checkpoint", any(flags) if cuda else None, f"async_save flags {flags}")
    start = [r for r in recs if r["kind"] == "start"]
    if start and train:
        line(f"{name}_timing", None,
             f"first logged step {train[0]['step']} at {train[0]['time'] - start[0]['time']:.1f}s "
             f"(compile included); step_time_s "
             f"{[round(r.get('step_time_s', 0), 3) for r in train]} "
             f"peak_mem_mb {train[-1].get('peak_mem_mb')}")
    reports = sorted(glob.glob(str(run / "logs" / "*" / "backend-rank-0.json")))
    if reports:
        text = json.dumps(json.loads(Path(reports[-1]).read_text()))
        line(f"{name}_backend_report", ("nccl" if cuda else "gloo") in text, text[:400])
        # enn-submit's local launcher forks its workers unless it has touched CUDA itself
        started = json.loads(Path(reports[-1]).read_text()).get("worker_start")
        line(f"{name}_worker_forked", started == "forked", f"worker_start={started}")
    step = sorted(glob.glob(str(run / "checkpoints" / "step-*[0-9]")),
                  key=lambda p: int(p.rsplit("-", 1)[1]))[-1]
    meta = FileSystemReader(step).read_metadata().state_dict_metadata
    dtypes = {k: str(v.properties.dtype) for k, v in meta.items() if hasattr(v, "properties")}
    kinds = sorted({(k.split(".")[0], d) for k, d in dtypes.items()})
    fp32 = bool(dtypes) and all(d == "torch.float32" for d in dtypes.values())
    if lora:
        frozen = [k for k in dtypes if k.startswith("model.") and "lora_" not in k]
        line("lora_checkpoint", fp32 and not frozen,
             f"{len(dtypes)} tensors {kinds}; frozen tensors saved: {frozen[:3]}")
    else:
        line("master_weights_fp32" if name == "full" else f"{name}_weights_fp32", fp32,
             f"(config.json says bfloat16) saved dtypes {kinds}")


def chunked_loss_memory(dev, small: bool) -> None:
    """The training loss of a 128k-vocabulary Llama with and without the full logits: the
    same loss and gradients, and (on CUDA) the peak memory and time of each."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from enn_cluster.models.causal_lm import CausalLM

    vocab, width, rows, seq = (4096, 64, 2, 64) if small else (128256, 1024, 2, 4096)
    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=width,
                               intermediate_size=4 * width, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = CausalLM(AutoModelForCausalLM.from_config(cfg).to(dev, torch.bfloat16))
    ids = torch.randint(0, vocab, (rows, seq), device=dev)
    cuda = dev.type == "cuda"
    out = {}
    for name, loss_of in (("full_logits", lambda: CausalLM.loss(model(ids), ids)),
                          ("chunked", lambda: model(ids, ids))):
        for _ in range(2):  # the second call is timed: the first pays for warming up
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base, t = (torch.cuda.memory_allocated() if cuda else 0), time.time()
            loss = loss_of()
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
        grad = model.base().get_output_embeddings().weight.grad.float()
        out[name] = (loss.item(), grad, (torch.cuda.max_memory_allocated() - base) / 1e9
                     if cuda else 0.0, time.time() - t)
    (l_full, g_full, m_full, t_full), (l_ch, g_ch, m_ch, t_ch) = out["full_logits"], out["chunked"]
    rel = ((g_full - g_ch).abs().max() / (g_full.abs().max() + 1e-12)).item()
    same = abs(l_full - l_ch) <= 2e-3 * abs(l_full) and rel < 5e-2
    line("chunked_loss_equal", same, f"loss {l_full:.5f} vs {l_ch:.5f}, head grad rel diff {rel:.3g}")
    if cuda:
        line("chunked_loss_memory", m_ch < 0.6 * m_full,
             f"vocab {vocab}, {rows}x{seq} tokens: peak GB full logits {m_full:.2f} "
             f"({t_full * 1e3:.0f} ms), chunked {m_ch:.2f} ({t_ch * 1e3:.0f} ms)")


def main() -> int:
    from enn_cluster.worker.environment import discover
    from enn_cluster.worker.lanes import lane_device, open_lanes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("DC_PORT", "29731"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env = discover(os.environ)
    dev = lane_device(env)
    if os.environ.get("DC_GPUS", "1") != "0" and dev.type != "cuda":
        line("micro", False, "no CUDA device (DC_GPUS=0 runs these checks on the CPU)")
        return 1
    node_checks(env, dev)
    open_lanes(env, 120, 60, 60, device=dev)
    x = torch.tensor([1.5, 2.0], dtype=torch.float64, device=dev)
    dist.all_reduce(x)
    backend = str(dist.get_backend())
    want = "nccl" if dev.type == "cuda" else "gloo"
    line("accelerator_lane", want in backend and x.tolist() == [1.5, 2.0],
         f"backend={backend} f64 all_reduce={x.tolist()}")
    compile_blocks = os.environ.get("DC_COMPILE", "true") == "true"
    small = bool(os.environ.get("DC_SMALL"))
    for name, check in (("fused_adamw_found_inf", lambda: fused_adamw_skip(dev)),
                        ("compile_ac_grads",
                         lambda: compile_and_checkpointing(dev, compile_blocks, small)),
                        ("chunked_loss_equal", lambda: chunked_loss_memory(dev, small))):
        try:
            check()
        except Exception as exc:  # one check's failure is a FAIL line; the others still run
            line(name, False, repr(exc)[:400])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "micro.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["assets"]:
        write_assets(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["inspect"]:
        inspect_run(Path(sys.argv[2]), *sys.argv[3:4])
    else:
        sys.exit(main())
