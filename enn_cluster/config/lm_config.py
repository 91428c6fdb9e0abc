"""The language-model pieces of the run config: what names a Hugging Face model, its task,
and the `lora` section (peft adapters over a frozen base)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from enn_cluster.config.checks import _bounded, _non_negative
from enn_cluster.errors import UserError

HF_PREFIX = "hf:"  # model.name of a Hugging Face causal LM: hf:/weights/dir or hf:cached-name
LM_TASK = "causal_lm"


TEXT_SUFFIXES = (".parquet", ".jsonl")  # text files a causal LM stages (tokenized once)


def is_hf_model(name: str) -> bool:
    return str(name).startswith(HF_PREFIX)


def takes_lora(model) -> bool:
    """Whether LoRA adapters apply to this model (`model`: the config's ModelConfig): a
    Hugging Face causal LM's linear layers; the config side of the kinds' rule."""
    return is_hf_model(model.name)


def is_text_data(data) -> bool:
    """A causal LM reads text files, tokenized at staging; token ids given as arrays (.npy,
    .npz or in memory) are staged as they are. `data`: the config's DataConfig."""
    return not str(data.train_path).endswith((".npy", ".npz"))


MAX_LORA_RANK = 4096


def peft_matches(name: str, target: str) -> bool:
    """Whether peft's `target_modules` entry `target` names the module `name`: the whole
    name, or its end after a dot."""
    return name == target or name.endswith("." + target)

# lora.target_modules given as a word: the decoder layers' attention projections (whatever
# the architecture calls them: Llama's q/k/v/o_proj, Phi-3's qkv_proj, GPT-NeoX's
# query_key_value, GPT-2's c_attn) or every linear of the layers (peft's "all-linear")
LORA_TARGET_WORDS = ("attention", "all-linear")


@dataclass
class LoraConfig:
    r: int = 0  # 0: full fine-tune; > 0: LoRA adapters of rank r, base weights frozen
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: Union[str, list] = "attention"  # a LORA_TARGET_WORDS, or module names

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def validate(self) -> None:
        _non_negative("lora.r", self.r)
        _bounded("lora.r", max(self.r, 1), MAX_LORA_RANK)
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) \
                or not 0 < self.alpha < 1e6:
            raise UserError(f"lora.alpha: {self.alpha!r} must be a number > 0, e.g. 32")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout: {self.dropout!r} must be in [0, 1), e.g. 0.05")
        if isinstance(self.target_modules, str):
            if self.target_modules not in LORA_TARGET_WORDS:
                raise UserError(f"lora.target_modules: {self.target_modules[:40]!r} must be "
                                "attention, all-linear or a list of module names, e.g. "
                                "[q_proj, v_proj]")
        elif not self.target_modules or not all(
                isinstance(m, str) and m.replace("_", "").replace(".", "").isalnum()
                for m in self.target_modules):
            raise UserError("lora.target_modules: must be a non-empty list of module names, "
                            "e.g. [q_proj, k_proj, v_proj, o_proj]")
