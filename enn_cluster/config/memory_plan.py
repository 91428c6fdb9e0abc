"""Will it fit? The per-GPU bytes of a training run, from the model's shape and the config.

Pure arithmetic (no torch): `ModelShape` is what the model built on the meta device shows
(its model kind measures it: models/kinds.py, client/model_shape.py); everything else comes from the config and the launch
shape. The formulas, per rank, with S the shard group size (HSDP: processes per node, FSDP:
the world, DDP: 1; `plan_mesh` decides it as the run will):

- full fine-tune (lora.r = 0), AdamW with fp32 master weights: parameters 4 bytes, gradients
  4 bytes, optimizer state 8 bytes (two fp32 moments) per parameter, each divided by S;
- LoRA (lora.r > 0): the frozen base stays in bf16 (2 bytes; 4 with training.bf16=false) and
  has neither gradients nor optimizer state; the adapters, r x (in + out) per targeted
  nn.Linear, take the 4 + 4 + 8 bytes of a full fine-tune; all divided by S;
- the all-gathered working copy of FSDP, in the compute dtype, counted with the parameters:
  two units at a time (the one computing and the one prefetched), the largest unit (a
  decoder layer, a causal LM's token embedding, or what the root keeps: the head and final
  norm) and the largest layer; none when
  S = 1 (the parameters are whole already);
- activations at micro-batch b and sequence length s (data.max_length; a built-in model's
  tokens per row otherwise), for L layers of width h and MLP width i, in bf16 (doubled in
  fp32): without checkpointing (18 h + 4 i) x s x b bytes per layer, 34 x s x h x b for the
  GPT layer (i = 4 h) of Korthikanti et al. 2022 with a fused attention that keeps no
  s x s scores (attention 11 h, norms 4 h, MLP input 2 h, dropout mask 1 h, and 2 i for
  each of the MLP's two wide tensors); a gated MLP (SwiGLU: gate, up, activation, product)
  keeps four wide tensors and no dropout mask, (17 h + 8 i) x s x b: 45 x s x h x b for
  Llama-3 (i = 3.5 h), where autograd saves 49 in transformers' Llama (its RMSNorm works in
  fp32); a checkpointed layer keeps only its input, 2 x s x h x b, and one layer at a time
  recomputes its activations during backward; `every_other` checkpoints every other layer;
  `selective` (per op) keeps in each layer its input, the attention's output and every
  other matmul's output (q, v, gate, down of q k v o gate up down: 5 h + i elements a
  token in a gated layer, 4 h + i in a GPT one, taking k and v as wide as q), the rest
  recomputed one layer at a time;
  plus the logits of a language model, tokens x vocab x 10 bytes (bf16 logits, their fp32
  copy and fp32 log-softmax for the loss): s x b tokens for a model whose loss needs its
  whole logits, one chunk of the loss (models/causal_lm.py, a few thousand tokens with a
  128k vocabulary) for the ones that compute it chunk by chunk.

A run fits when the total is at most the usable memory: `gpu_mem_gb` less 10 % (allocator
fragmentation, temporary buffers) and 1 GB (CUDA context, NCCL buffers). GB are 10**9 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.config.lm_config import peft_matches, takes_lora
from enn_cluster.config.run_config import CHECKPOINTING_MODES, RunConfig, plan_mesh
from enn_cluster.config.schedule import plan_batch, requested_global_batch
from enn_cluster.errors import Said, UserError

GB = 1e9
HEADROOM_FRACTION = 0.10  # of the GPU's memory, kept free for fragmentation and buffers
CONTEXT_GB = 1.0  # CUDA context and NCCL buffers per process
DEFAULT_GPU_MEM_GB = 80.0  # an H100 / A100 80 GB
CKPT_BYTES_PER_LAYER = 2  # a checkpointed layer keeps its bf16 input only
LOGIT_BYTES = 10  # bf16 logits + fp32 copy + fp32 log-softmax, per token per vocab entry
SUGGESTED_LORA_RANK = 16


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know of a model (read off the meta-device build)."""

    params: int  # every parameter (tied ones once)
    layers: int  # blocks sharded one by one (decoder layers)
    hidden: int  # width of the activations between layers
    tokens: int  # tokens per row: 0 for a language model (data.max_length decides)
    vocab: int  # 0: no language-model head
    largest_unit: int  # parameters of the largest FSDP unit (a layer, the embedding, the root's rest)
    largest_layer: int  # parameters of the largest layer
    linears: tuple = ()  # (qualified name, in_features, out_features) of every nn.Linear
    intermediate: int = 0  # the MLP's width (0: 4 x hidden)
    gated: bool = False  # a gated MLP (SwiGLU: gate_proj and up_proj)
    loss_chunk_tokens: int = 0  # tokens whose logits the chunked loss holds (0: all of them)
    lora_targets: tuple = ()  # the module names LoRA adapts (lora.target_modules resolved)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank; `activations` at the configured checkpointing, the others beside it."""

    params: float
    grads: float
    optimizer: float
    activations: float
    activations_none: float
    activations_full: float
    usable: float
    shard_group: int
    micro_batch: int
    seq_len: int
    trainable_params: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def as_json(self) -> dict:
        """The issue's keys first (GB, rounded to 0.01), then the extras."""
        gb = lambda v: round(v / GB, 2)  # noqa: E731
        return {"params_gb": gb(self.params), "grads_gb": gb(self.grads),
                "optimizer_gb": gb(self.optimizer), "activations_gb": gb(self.activations),
                "total_gb": gb(self.total), "fits": self.fits, "usable_gb": gb(self.usable),
                "activations_no_checkpointing_gb": gb(self.activations_none),
                "activations_full_checkpointing_gb": gb(self.activations_full),
                "shard_group": self.shard_group, "micro_batch": self.micro_batch,
                "seq_len": self.seq_len, "trainable_params": self.trainable_params}


def lora_params(linears, target_modules, r: int) -> int:
    """r x (in + out) for every nn.Linear whose name is a target (peft's suffix match)."""
    return sum(r * (fan_in + fan_out) for name, fan_in, fan_out in linears
               if any(peft_matches(name, t) for t in target_modules))


def layer_bytes_per_token(model: ModelShape) -> float:
    """Bytes one layer saves for backward per token in bf16, without checkpointing."""
    h, i = model.hidden, model.intermediate or 4 * model.hidden
    return 17 * h + 8 * i if model.gated else 18 * h + 4 * i


def activation_bytes(layers: int, per_token: float, tokens: float, hidden: int,
                     mode: str, selective_per_token: float = 0.0) -> float:
    """Saved activations of `layers` layers of `per_token` bytes per token for `tokens`
    tokens (s x b; doubled in fp32); a checkpointed layer keeps its input of `hidden`,
    or under `selective` the `selective_per_token` bytes its op policy saves."""
    full = per_token * tokens
    kept = (selective_per_token if mode == "selective" else CKPT_BYTES_PER_LAYER * hidden) \
        * tokens
    checkpointed = {"none": 0, "selective": layers, "every_other": layers // 2,
                    "full": layers}[mode]
    # one layer's activations rebuilt at a time (under `selective`, what it did not keep)
    recompute = 0.0 if not checkpointed else full - kept if mode == "selective" else full
    return (layers - checkpointed) * full + checkpointed * kept + recompute


def selective_bytes_per_token(model: ModelShape) -> float:
    """Bytes one layer keeps per token in bf16 under per-op selective checkpointing."""
    h, i = model.hidden, model.intermediate or 4 * model.hidden
    return 2 * (5 * h + i) if model.gated else 2 * (4 * h + i)


def usable_bytes(gpu_mem_gb: float) -> float:
    return max(gpu_mem_gb * (1 - HEADROOM_FRACTION) - CONTEXT_GB, 0.0) * GB


def memory_plan(cfg: RunConfig, model: ModelShape, nodes: int, gpus_per_node: int,
                gpu_mem_gb: float = DEFAULT_GPU_MEM_GB) -> MemoryPlan:
    """The per-rank bytes of training `model` under `cfg` on nodes x gpus_per_node GPUs."""
    world = nodes * gpus_per_node
    shard = plan_mesh(cfg.parallel, world, gpus_per_node).shard
    micro = plan_batch(cfg.training, world, gpus_per_node).micro_batch
    bf16 = cfg.training.bf16 != "false"  # auto: bf16 on GPUs
    compute = 2 if bf16 else 4
    if cfg.lora.enabled:
        trainable = lora_params(model.linears, model.lora_targets, cfg.lora.r)
        stored = model.params * compute + trainable * 4
    else:
        trainable = model.params
        stored = model.params * 4
    gathered = (model.largest_unit + model.largest_layer) * compute if shard > 1 else 0
    seq = model.tokens or cfg.data.max_length  # 0: a language model's rows, max_length long
    tokens = seq * micro * (compute / 2)
    alive = seq * micro if not model.loss_chunk_tokens else min(seq * micro,
                                                                 model.loss_chunk_tokens)
    logits = alive * model.vocab * LOGIT_BYTES
    acts = {mode: activation_bytes(model.layers, layer_bytes_per_token(model), tokens,
                                   model.hidden, mode, selective_bytes_per_token(model)) + logits
            for mode in CHECKPOINTING_MODES}
    return MemoryPlan(params=stored / shard + gathered, grads=trainable * 4 / shard,
                      optimizer=trainable * 8 / shard,
                      activations=acts[cfg.parallel.activation_checkpointing],
                      activations_none=acts["none"], activations_full=acts["full"],
                      usable=usable_bytes(gpu_mem_gb), shard_group=shard, micro_batch=micro,
                      seq_len=seq, trainable_params=trainable)


def fix_candidates(cfg: RunConfig, world: int) -> list[tuple[str, RunConfig]]:
    """Each fix a plan that does not fit can take alone, as the `--set`s that make it: more
    shards, activation checkpointing, a smaller micro-batch (the global batch kept), LoRA;
    in that order of cost (LoRA last: it changes what is trained)."""
    return [(key, fix(cfg)) for key, fix in _fixes(cfg, world)]


def _fixes(cfg: RunConfig, world: int) -> list:
    """(key, cfg -> cfg) for each fix that applies to `cfg`, cheapest first (pure)."""
    out = []
    par, train = cfg.parallel, cfg.training
    if par.strategy != "fsdp":
        out.append(("parallel.strategy=fsdp", lambda c: replace(
            c, parallel=replace(c.parallel, strategy="fsdp"))))
    if par.activation_checkpointing != "full":
        out.append(("parallel.activation_checkpointing=full", lambda c: replace(
            c, parallel=replace(c.parallel, activation_checkpointing="full"))))
    if train.per_device_train_batch_size > 1:
        rows = requested_global_batch(train, world)
        out.append((f"training.per_device_train_batch_size=1 --set "
                    f"training.global_batch_size={rows}", lambda c: replace(
                        c, training=replace(c.training, per_device_train_batch_size=1,
                                            global_batch_size=rows))))
    if not cfg.lora.enabled and takes_lora(cfg.model):
        out.append((f"lora.r={SUGGESTED_LORA_RANK}",
                    lambda c: replace(c, lora=replace(c.lora, r=SUGGESTED_LORA_RANK))))
    return out


def combined_fix(cfg: RunConfig, model: ModelShape, nodes: int, gpus_per_node: int,
                 gpu_mem_gb: float) -> Optional[tuple[str, MemoryPlan]]:
    """When no fix that keeps the run's training fits alone: the fewest such fixes that fit
    together, the cheapest set (in fix_candidates' order); None when none does. LoRA is not
    among them: it fits alone often, but trains something else."""
    fixes = [(key, fix) for key, fix in _fixes(cfg, nodes * gpus_per_node)
             if not key.startswith("lora.")]
    for size in range(2, len(fixes) + 1):
        for chosen in combinations(fixes, size):  # cheapest first: itertools keeps order
            fixed = cfg
            for _, fix in chosen:
                fixed = fix(fixed)
            plan = memory_plan(fixed, model, nodes, gpus_per_node, gpu_mem_gb)
            if plan.fits:
                return " --set ".join(key for key, _ in chosen), plan
    return None


def refusal(cfg: RunConfig, model: ModelShape, nodes: int, gpus_per_node: int,
            gpu_mem_gb: float = DEFAULT_GPU_MEM_GB) -> str:
    """One line: why the plan does not fit and the fixes, each with its total ("" if it fits)."""
    refused = memory_refusal(cfg, model, nodes, gpus_per_node, gpu_mem_gb)
    return str(refused) if refused else ""


def memory_refusal(cfg: RunConfig, model: ModelShape, nodes: int, gpus_per_node: int,
                   gpu_mem_gb: float = DEFAULT_GPU_MEM_GB) -> Optional[UserError]:
    """`refusal` as the UserError a launch raises (each fix a --set, or the API's keyword
    sections); None when the plan fits."""
    plan = memory_plan(cfg, model, nodes, gpus_per_node, gpu_mem_gb)
    if plan.fits:
        return None
    tried = [(key, memory_plan(fixed, model, nodes, gpus_per_node, gpu_mem_gb))
             for key, fixed in fix_candidates(cfg, nodes * gpus_per_node)]
    tried = sorted(tried, key=lambda kp: kp[1].total)
    if not any(p.fits for key, p in tried if not key.startswith("lora.")):
        both = combined_fix(cfg, model, nodes, gpus_per_node, gpu_mem_gb)
        tried = ([both] if both else []) + tried
    sets = {f"fix{i}": tuple(Said(INPUTS["set"], one) for one in key.split(" --set "))
            for i, (key, _) in enumerate(tried)}  # each fix: one or more --set
    fixes = ", ".join(f"{{fix{i}}} ({p.total / GB:.1f} GB{', fits' if p.fits else ''})"
                      for i, (_, p) in enumerate(tried))
    return UserError(
        f"plan: {nodes} x {gpus_per_node} GPUs need {plan.total / GB:.1f} GB per GPU "
        f"(parameters {plan.params / GB:.1f}, gradients {plan.grads / GB:.1f}, optimizer "
        f"{plan.optimizer / GB:.1f}, activations {plan.activations / GB:.1f}; shards of "
        f"{plan.shard_group}) but {plan.usable / GB:.1f} of {gpu_mem_gb:g} GB are usable; "
        f"fix: {fixes or 'a GPU with more memory'}"
        f"{', or more nodes' if cfg.parallel.strategy == 'fsdp' else ''} "
        f"(details: enn-submit plan)", **sets)

