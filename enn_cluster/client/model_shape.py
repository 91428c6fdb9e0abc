"""The run's model built on the meta device (no memory, no weights read), measured for the
memory plan: parameter count, layers, widths, every nn.Linear. The arithmetic is
config/memory_plan.py; this is the only part of `plan` that needs torch (and transformers,
for `hf:` models).
"""
from __future__ import annotations

import math

from typing import Optional

from enn_cluster.config.memory_plan import DEFAULT_GPU_MEM_GB, ModelShape, refusal
from enn_cluster.config.lm_config import is_hf_model
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError


def check_fits(cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gb: Optional[float],
               arrays_given: bool = False) -> None:
    """`train` and `prepare` on GPUs: a run whose memory plan does not fit one GPU is refused
    in one line naming the fixes, before anything is written. Left to the run: a module
    given to the API as an object, and a built-in model or factory fed arrays by the API
    (their shapes are known at staging)."""
    if gpus_per_node <= 0 or (arrays_given and not is_hf_model(cfg.model.name)):
        return
    from enn_cluster.storage.model_structure import FACTORY  # imports torch

    if cfg.model.name == FACTORY:
        return
    why = refusal(cfg, model_shape(cfg), nodes, gpus_per_node, gpu_mem_gb or DEFAULT_GPU_MEM_GB)
    if why:
        raise UserError(why)


def replica_fits(cfg: RunConfig, gpus_per_node: int, gpu_mem_gb: Optional[float]) -> bool:
    """Whether one GPU holds a causal LM's whole bf16 replica (prediction's default); a model
    that does not is predicted sharded instead. CPU runs: always."""
    if gpus_per_node <= 0 or not is_hf_model(cfg.model.name):
        return True
    from enn_cluster.config.memory_plan import usable_bytes

    return model_shape(cfg).params * 2 <= usable_bytes(gpu_mem_gb or DEFAULT_GPU_MEM_GB)


def model_shape(cfg: RunConfig) -> ModelShape:
    """The shape of `cfg.model`: a Hugging Face model from its config.json, a built-in model or
    factory from the data's shape (synthetic, or the arrays' headers; no data is read)."""
    import torch

    if is_hf_model(cfg.model.name):
        from enn_cluster.models import repeated_blocks
        from enn_cluster.models.causal_lm import bare_lm

        with torch.device("meta"):
            model = bare_lm(cfg.model.name)
        config = model.config.get_text_config()
        return _measure(model, repeated_blocks(model), int(config.hidden_size), 0,
                        int(config.vocab_size))
    from enn_cluster.models import FeatureTransformer, build_model, model_blocks

    input_shape, n_outputs = _data_shape(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, input_shape, n_outputs)
    widths = [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if isinstance(model, FeatureTransformer):
        tokens, hidden = (input_shape[0] if len(input_shape) == 2 else math.prod(input_shape),
                          cfg.model.d_model)
    else:
        tokens, hidden = 1, max(widths, default=1)
    return _measure(model, model_blocks(model), hidden, tokens, 0)


def _measure(model, blocks: list, hidden: int, tokens: int, vocab: int) -> ModelShape:
    from torch import nn

    params = sum(p.numel() for p in model.parameters())
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, nn.Linear))
    intermediate, gated = _mlp_width(blocks[0] if blocks else model, hidden)
    return ModelShape(params=params, layers=max(len(blocks), 1), hidden=hidden, tokens=tokens,
                      vocab=vocab, largest_unit=max(block_params + [params - sum(block_params)]),
                      largest_layer=max(block_params, default=0), linears=linears,
                      intermediate=intermediate, gated=gated)


def _mlp_width(block, hidden: int) -> tuple[int, bool]:
    """The MLP of a layer: the widest Linear hidden -> i that a Linear i -> hidden brings
    back; gated (SwiGLU) when two such Linears feed it. (0, False) when none is found."""
    from torch import nn

    shapes = [(m.in_features, m.out_features) for m in block.modules() if isinstance(m, nn.Linear)]
    wide = [o for i, o in shapes if i == hidden and o > hidden and (o, hidden) in shapes]
    width = max(wide, default=0)
    return width, wide.count(width) >= 2


def _data_shape(cfg: RunConfig) -> tuple[tuple, int]:
    """(input shape of one row, outputs) as staging will find them; a classifier's classes
    are counted from its labels at staging, here taken as the synthetic ones or 2."""
    from enn_cluster.storage.data_sources import array_shape

    data, classify = cfg.data, cfg.model.task == "classification"
    if data.train_path == "synthetic":
        syn = data.synthetic
        return (syn.n_features,), max(syn.n_outputs, 2) if classify else syn.n_outputs
    npz = data.train_path.endswith(".npz")
    x = array_shape("data.train_path", data.train_path, data.x_key if npz else None)
    if classify:
        return tuple(x[1:]), 2
    y_path = data.train_targets_path or data.train_path
    y = array_shape("data.train_targets_path" if data.train_targets_path else "data.train_path",
                    y_path, data.y_key if y_path.endswith(".npz") else None)
    return tuple(x[1:]), math.prod(y[1:]) if len(y) > 1 else 1
