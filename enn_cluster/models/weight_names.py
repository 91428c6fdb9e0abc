"""The names of a causal LM's base weights: ours (`lm.` + the transformers model's; under
LoRA, peft's), the transformers model's, and the weights folder's (what save_pretrained
wrote). The last two differ where transformers renames a checkpoint's tensors as it loads
them (its conversion mapping: GPT-NeoX's `embed_out` is the model's `lm_head`); the folder's
names are what the workers read and the export writes, so that any transformers loads the
result. Where transformers merges several of a checkpoint's tensors into one (Mixtral's and
Qwen-MoE's experts, stacked) no name matches one to one, and the folder is refused in one
line: the per-rank reads of the files cannot merge them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from torch import nn

from enn_cluster.errors import UserError
from enn_cluster.models.safetensors_header import check_shapes, tensors

PEFT_PREFIX = "base_model.model."


def hf_name(ours: str) -> str:
    """Our parameter name -> the transformers model's state-dict name."""
    name = ours.removeprefix("lm.").removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def folder_names(model: nn.Module, in_files: Iterable[str]) -> dict[str, str]:
    """{the model's name: the folder's} for each tensor of the folder (`in_files`, its
    names) that transformers renames as it loads it; UserError for one it merges. `model`:
    ours, peft's or transformers' own (built on any device)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    lm = _transformers_model(model)
    transforms = get_model_conversion_mapping(lm)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out = {}
    for name in in_files:
        renamed, merged = rename_source_key(name, renamings, converters)
        if merged is not None:
            kind = lm.config.model_type
            raise UserError(f"model.name: transformers merges tensors of a {kind} checkpoint "
                            f"as it loads it ({name} into {renamed}), which the workers' "
                            f"per-rank reads of the files cannot do; {kind} models cannot "
                            "be run here yet: choose a model of another architecture")
        if renamed != name:
            out[renamed] = name
    return out


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside ours (CausalLM.lm) and peft's wrapper."""
    lm = getattr(model, "lm", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def base_targets(model: nn.Module, in_files: Iterable[str]) -> dict:
    """{name in the weights folder: the tensor} for every base parameter and persistent
    buffer (a tied pair once: the files hold it once). `in_files`: the folder's names."""
    renamed = folder_names(model, in_files)
    buffers = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    out = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if name not in buffers and not is_adapter(name):
            hf = hf_name(name)
            out.setdefault(renamed.get(hf, hf), tensor)
    return out


def folder_targets(model: nn.Module, folder: Path) -> dict:
    """base_targets under the names the files of `folder` hold, each there in the shape
    the model needs (one read of the headers; the client's check and the workers' read)."""
    found = tensors(folder)
    targets = base_targets(model, found)
    check_shapes(folder, {n: tuple(t.shape) for n, t in targets.items()}, found=found)
    return targets
