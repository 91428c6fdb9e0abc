"""Will the run fit, before anything is written: the model's kind measures it on the meta
device (no memory, no weights read: models/kinds.py `meta_shape`), from the data's shape as
staging will find it where the kind needs that (`_data_shape`: no data is read); the
arithmetic is config/memory_plan.py. The only part of `plan` that needs torch.
"""
from __future__ import annotations

import math
from typing import Optional

from enn_cluster.config.lm_config import is_hf_model
from enn_cluster.config.memory_plan import DEFAULT_GPU_MEM_GB, ModelShape, memory_refusal
from enn_cluster.config.run_config import RunConfig


def check_fits(cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gb: Optional[float],
               arrays_given: bool = False) -> None:
    """`train` and `prepare`: a user's factory is built on the meta device, so that what it
    returns is checked here rather than on every rank; on GPUs, a run whose memory plan
    does not fit one GPU is refused in one line naming the fixes. Both before anything is
    written. Left to the run: a module given to the API as an object, a model whose shape
    comes from arrays the API feeds it (known at staging), and a factory that cannot build
    on the meta device (the workers build it whole)."""
    from enn_cluster.models import kind_of

    user_factory = ":" in cfg.model.name and not is_hf_model(cfg.model.name)
    if (gpus_per_node <= 0 and not user_factory) or (arrays_given
                                                     and kind_of(cfg).uses_data_shape()):
        return
    from enn_cluster.storage.model_structure import FACTORY  # imports torch

    if cfg.model.name == FACTORY:
        return
    shape = model_shape(cfg)
    if shape is None or gpus_per_node <= 0:
        return
    why = memory_refusal(cfg, shape, nodes, gpus_per_node, gpu_mem_gb or DEFAULT_GPU_MEM_GB)
    if why:
        raise why


def replica_fits(cfg: RunConfig, gpus_per_node: int, gpu_mem_gb: Optional[float]) -> bool:
    """Whether one GPU holds the model's whole bf16 replica (prediction's default); a model
    that can be predicted sharded and does not is predicted sharded instead. CPU runs:
    always."""
    from enn_cluster.models import kind_of

    if gpus_per_node <= 0 or not kind_of(cfg).predicts_sharded:
        return True
    from enn_cluster.config.memory_plan import usable_bytes

    shape = model_shape(cfg)
    return shape is None or shape.params * 2 <= usable_bytes(gpu_mem_gb or DEFAULT_GPU_MEM_GB)


def model_shape(cfg: RunConfig) -> Optional[ModelShape]:
    """The shape of `cfg.model`, as its kind measures it on the meta device: a Hugging Face
    model from its config.json, a built-in model or factory from the data's shape
    (synthetic, or the arrays' headers; no data is read). None for a user's factory that
    cannot build there (one calling from_pretrained): its workers build it whole."""
    from enn_cluster.errors import UserError
    from enn_cluster.models import ARRAYS, kind_of

    kind = kind_of(cfg)
    if kind is ARRAYS:
        kind.check(cfg)  # a factory's keywords, before it is called
    try:
        return kind.meta_shape(cfg, lambda: _data_shape(cfg))
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - the factory's own error on the meta device
        if ":" not in cfg.model.name or is_hf_model(cfg.model.name):
            raise
        return None


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
