"""Hugging Face causal LMs (`model.name: hf:DIR`): built from the weights directory's
config.json, LoRA adapters from peft, and the next-token loss with masked labels.

The module is built wherever the caller's default device says: on the meta device in the
workers (sharded first, then each rank reads its own shards of the safetensors: see
worker/lm_weights.py), on the CPU for export and `Run.load_model`. Weights come from a local
directory or the local HF cache only; never from the network at run time.

State-dict names are ours (`lm.` + the HF names; under LoRA, peft's): `hf_name` maps a
parameter back to its name in the safetensors files.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from enn_cluster.config.hf_name import weights_dir
from enn_cluster.config.lm_config import HF_PREFIX, LoraConfig
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError

IGNORE_INDEX = -100  # a label the loss skips: pads and prompt tokens (staged that way)
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's adapter name


def hf_config(path: Path):
    """The weights directory's config.json (never the network); one line when unusable."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"model.name: {HF_PREFIX}{path}: no usable config.json "
                        f"({str(exc).splitlines()[0][:160]}); give the directory "
                        "save_pretrained wrote") from None


def bare_lm(name: str) -> nn.Module:
    """The transformers model `name` (`hf:...`) names, built from its config on the current
    default device, weights random; no LoRA."""
    from transformers import AutoModelForCausalLM

    config = hf_config(weights_dir(name))
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise UserError(f"model.name: {name}: {config.model_type!r} is not a causal LM "
                        f"transformers can build ({str(exc).splitlines()[0][:160]})") from None


def with_lora(lm: nn.Module, lora: LoraConfig) -> nn.Module:
    """peft's LoRA on the target modules; every base parameter frozen."""
    from peft import LoraConfig as PeftLora, get_peft_model

    missing = [t for t in lora.target_modules
               if not any(n.rsplit(".", 1)[-1] == t for n, _ in lm.named_modules())]
    if missing:
        raise UserError(f"lora.target_modules: {missing} match no module of the model; pick "
                        "from its linear layers (e.g. q_proj, k_proj, v_proj, o_proj)")
    spec = PeftLora(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", category=FutureWarning)
        return get_peft_model(lm, spec, adapter_name=ADAPTER)


class CausalLM(nn.Module):
    """A Hugging Face causal LM as our runtime sees a model: `forward(input_ids)` gives the
    logits, `loss(logits, labels)` the mean next-token cross-entropy over the labels that
    are not IGNORE_INDEX (the model shifts; staging does not), `blocks()` the decoder layers
    that FSDP shards one by one."""

    input_dtype = torch.long  # token ids: never a float (models.input_dtype)

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids.long(), use_cache=False).logits

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean over the counted tokens (0, not NaN, for a batch with none: it trains nothing)."""
        shifted = labels[:, 1:].long().reshape(-1)
        flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
        total = F.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / (shifted != IGNORE_INDEX).sum().clamp(min=1)

    def blocks(self) -> list[nn.Module]:
        return decoder_layers(self.base())

    def base(self) -> nn.Module:
        """The transformers model (under LoRA, the one peft wraps)."""
        lm = self.lm
        return lm.get_base_model() if hasattr(lm, "get_base_model") else lm

    @property
    def has_lora(self) -> bool:
        return hasattr(self.lm, "peft_config")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules the model itself names as never to be split (`_no_split_modules`: its
    decoder layer class), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def build_causal_lm(cfg: RunConfig) -> CausalLM:
    """The model of `cfg` on the current default device, with LoRA where `lora.r` > 0.
    Its weights are random here (meta in the workers): the caller loads the base weights."""
    lm = bare_lm(cfg.model.name)
    if cfg.lora.enabled:
        lm = with_lora(lm, cfg.lora)
    return CausalLM(lm)


def hf_name(ours: str) -> str:
    """Our parameter name -> its name in the weights directory's safetensors."""
    name = ours.removeprefix("lm.").removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_" in name
