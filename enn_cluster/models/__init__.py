"""The models a run can have, by kind: `kind_of(cfg)` is the one place a config's kind is
decided (models/kinds.py says what a kind answers: ArraysKind there, CausalLMKind and
LoraKind in models/causal_lm.py, or a user's own named by `module:KindClass`). The built-in
models and what every model fed arrays shares are in models/builtin.py, imported on first
use (`from enn_cluster.models import MLP` works): this package imports no torch itself, so
the client can ask a kind before it refuses bad input.
"""
from __future__ import annotations

import math

from enn_cluster.config.lm_config import is_hf_model
from enn_cluster.config.run_config import RunConfig
from enn_cluster.models.kinds import (  # noqa: F401  (re-exported: every side asks here)
    ARRAYS,
    ArraysKind,
    ModelKind,
    check_factory,
    import_factory,
    measure,
    model_blocks,
    repeated_blocks,
    shard_units,
    quiet_library_logs,
)

BUILTIN_MODELS = ("mlp", "transformer")  # model.name values that are not `module:factory`
_BUILTIN = ("MLP", "FeatureTransformer", "build_model", "input_dtype", "compute_loss",
            "model_loss", "loss_weight")


def __getattr__(name: str):
    """The built-in models and helpers (models/builtin.py, torch), imported on first use."""
    if name in _BUILTIN:
        from enn_cluster.models import builtin

        return getattr(builtin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_run_model(cfg: RunConfig, input_shape: tuple, n_outputs: int):
    """The run's model on the current default device, as its kind builds it (a causal LM's
    base weights still to load)."""
    return kind_of(cfg).build(cfg, input_shape, n_outputs)


def kind_of(cfg: RunConfig) -> ModelKind:
    """The kind of `cfg`'s model: a causal LM (`hf:`; LoRA with lora.r > 0), a kind of the
    user's named by `module:KindClass` (a ModelKind subclass, or an instance), else a model
    fed arrays."""
    name = cfg.model.name
    if is_hf_model(name):
        from enn_cluster.models.causal_lm import CAUSAL_LM, LORA

        return LORA if cfg.lora.enabled else CAUSAL_LM
    if ":" in name:
        named = check_factory(name)  # one line when it does not import
        if isinstance(named, type) and issubclass(named, ModelKind):
            return named()
        if isinstance(named, ModelKind):
            return named
    return ARRAYS


def output_size(cfg: RunConfig, manifest: dict) -> int:
    if cfg.model.task == "classification":
        return int(manifest.get("n_classes", 2))
    shape = manifest["entries"]["train_y"]["shape"]
    return math.prod(int(d) for d in shape[1:]) if len(shape) > 1 else 1
