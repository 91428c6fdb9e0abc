"""Hugging Face causal LMs (`model.name: hf:DIR`): built from the weights directory's
config.json (and generation_config.json, as from_pretrained reads it), LoRA adapters from
peft, the next-token loss with masked labels, and the two kinds (models/kinds.py) that
answer for such a run: CausalLMKind (every weight trains) and LoraKind (peft adapters over
a frozen base). What a prediction computes of a row is models/lm_outputs.py's.

The module is built wherever the caller's default device says: on the meta device in the
workers (sharded first, then each rank reads its own shards of the safetensors: see
worker/lm_weights.py), on the CPU for export and `Run.load_model`. Weights come from a local
directory or the local HF cache only; never from the network at run time.

State-dict names are ours (`lm.` + the HF names; under LoRA, peft's): models/weight_names.py
maps them to the names in the weights folder's safetensors files.

Training never makes the full logits: `forward(ids, labels)` runs the decoder, then the LM
head and the cross-entropy chunk by chunk (models/lm_loss.py). Models whose head is more
than a linear layer fall back to the logits.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from enn_cluster.config.hf_name import check_sampling, end_token_ids, weights_dir
from enn_cluster.config.lm_config import HF_PREFIX, LoraConfig, is_text_data
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError
from enn_cluster.models.kinds import ModelKind, measure, shard_units
from enn_cluster.models.lm_inputs import (check_max_length, check_packing, check_row_lengths,
                                          check_token_ids, lora_targets, position_limit,
                                          positions_needed)
from enn_cluster.models.lm_loss import (IGNORE_INDEX, chunked_loss, learned_tokens,
                                        loss_chunk_tokens, next_token_loss, packed_positions)
from enn_cluster.models.lm_outputs import PAD, generate, generate_in_step, score
from enn_cluster.models.weight_names import folder_targets

# Architectures whose logits are exactly lm_head(final hidden state): the chunked loss is
# theirs to use. Others (Gemma 2's soft-capping, Cohere's logit scale) compute the logits.
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                              "qwen3_moe", "phi3", "olmo", "olmo2", "granite"})
ADAPTER = "default"  # peft's adapter name
# Architectures that keep packed documents apart given positions that restart at each
# (transformers' packed-sequence mask), each held to its documents run alone in
# tests/models/test_packed_documents.py. Others ignore the positions (Bloom's and MPT's
# ALiBi) or build their mask without them (OPT): their packed documents would see one
# another, so packed text is refused for them (lm_inputs.check_packing).
PACKS_DOCUMENTS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "phi", "gemma",
                             "gemma2", "gemma3_text", "olmo2", "granite", "stablelm",
                             "starcoder2", "cohere", "falcon", "gpt2", "gpt_bigcode"})


def hf_config(path: Path):
    """The weights directory's config.json (never the network); one line when unusable."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True,
                                          trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"model.name: {HF_PREFIX}{path}: no usable config.json "
                        f"({str(exc).splitlines()[0][:160]}); give the directory "
                        "save_pretrained wrote") from None


def bare_lm(name: str) -> nn.Module:
    """The transformers model `name` (`hf:...`) names, built from its config on the current
    default device, weights random; no LoRA."""
    from transformers import AutoModelForCausalLM

    folder = weights_dir(name)
    config = hf_config(folder)
    try:
        lm = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError as exc:
        raise UserError(f"model.name: {name}: {config.model_type!r} is not a causal LM "
                        f"transformers can build ({str(exc).splitlines()[0][:160]})") from None
    if (folder / "generation_config.json").is_file():  # as from_pretrained: its end tokens,
        lm.generation_config = generation_config(folder)  # its sampling settings
    return lm


def generation_config(folder: Path):
    """The folder's generation_config.json as transformers reads it; one line when not."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"model.name: {folder}/generation_config.json does not load "
                        f"({str(exc).splitlines()[0][:160]}); restore the file "
                        "save_pretrained wrote") from None


def with_lora(lm: nn.Module, lora: LoraConfig) -> nn.Module:
    """peft's LoRA on the target modules; every base parameter frozen."""
    from peft import LoraConfig as PeftLora, get_peft_model

    spec = PeftLora(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                    target_modules=lora_targets(lm, lora, decoder_layers(lm)),
                    task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", category=FutureWarning)
        return get_peft_model(lm, spec, adapter_name=ADAPTER)


class CausalLM(nn.Module):
    """A Hugging Face causal LM as our runtime sees a model: `forward(input_ids)` gives the
    logits, `loss(logits, labels)` the mean next-token cross-entropy over the labels that
    are not IGNORE_INDEX (the model shifts; staging does not), `blocks()` the decoder layers
    that FSDP shards one by one."""

    input_dtype = torch.long  # token ids: never a float (models.input_dtype)

    def __init__(self, lm: nn.Module, document_end: Optional[int] = None) -> None:
        super().__init__()
        self.lm = lm
        # rows of packed documents, each ended by this id (CausalLMKind.bind_data): a
        # document's tokens see only its own, positions restarting at each (None: a row
        # is one sequence)
        self.document_end = document_end

    def forward(self, input_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits; with `labels`, the loss (chunked where `loss_in_forward`). With
        labels (training, eval) a packed row's documents are kept apart."""
        ids = input_ids.long()
        positions = None
        if labels is not None and self.document_end is not None:
            positions = packed_positions(ids, self.document_end)
        if labels is None or not self.loss_in_forward:
            logits = self.lm(input_ids=ids, position_ids=positions, use_cache=False).logits
            return logits if labels is None else self.loss(logits, labels)
        base = self.base()
        hidden = base.get_decoder()(input_ids=ids, position_ids=positions,
                                    use_cache=False).last_hidden_state
        head = base.get_output_embeddings()
        return chunked_loss(hidden, head, labels, loss_chunk_tokens(head.out_features))

    @staticmethod
    def learned_tokens(labels: torch.Tensor) -> torch.Tensor:
        return learned_tokens(labels)

    @property
    def loss_in_forward(self) -> bool:
        """The loss from the final hidden states, chunk by chunk (models.model_loss): for
        the architectures whose logits are the LM head's output and nothing more."""
        config = self.base().config
        return (config.model_type in PLAIN_HEAD_TYPES
                and not getattr(config, "final_logit_softcapping", None)
                and getattr(config, "logit_scale", None) in (None, 1.0)  # Cohere's
                and getattr(config, "logits_scaling", None) in (None, 1.0)  # Granite's
                and isinstance(self.base().get_output_embeddings(), nn.Linear))

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits, labels)

    def blocks(self) -> list[nn.Module]:
        return decoder_layers(self.base())

    def leading_units(self) -> list[nn.Module]:
        """FSDP units before the blocks (models.shard_units): the token embedding, which the
        root would otherwise hold whole (vocabulary x hidden: 0.5 B parameters in Llama-3
        8B) from the step's start to its end; the final norm and the head stay with the
        root, which the chunked loss calls once per chunk (a unit of their own would be
        gathered and reduced once per chunk)."""
        return [self.base().get_input_embeddings()]

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
    return [m for m in model.modules()  # by its classes: fully_shard subclasses it
            if any(cls.__name__ in names for cls in type(m).__mro__)]


MAX_NEW_TOKENS = 1 << 16  # predict --generate


# transformers' model machinery (its top-level import is lazy): what every LM worker imports
LM_WORKER_IMPORTS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")


class CausalLMKind(ModelKind):
    """A Hugging Face causal LM whose every weight trains (lora.r = 0)."""

    name = "causal_lm"
    export_formats = ("hf",)  # besides every model's torch and export
    predicts_sharded = True
    compares_fp32 = False  # a second whole LM beside the replica, for the check: not kept
    same_row_shape = False  # rows of token ids of any length (right-padded with -1)

    def check(self, cfg: RunConfig) -> None:
        """The llm extra installed, and a weights directory whose safetensors headers give
        every tensor the model built from its config.json needs, in that shape."""
        import importlib.util

        name = cfg.model.name
        missing = [m for m in ("transformers", "safetensors")
                   if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"model.name: {name} needs {' and '.join(missing)}; "
                            "pip install 'enn_cluster[llm]' (and in the image)")
        path = weights_dir(name)
        if not any(path.glob("*.safetensors")):
            raise UserError(f"model.name: {path} has no *.safetensors weights; save the model "
                            "with save_pretrained(..., safe_serialization=True) there")
        with torch.device("meta"):  # no storage: only the shapes are wanted
            model = bare_lm(name)
        folder_targets(model, path)
        self.check_built(cfg, model)

    def check_built(self, cfg: RunConfig, model) -> None:
        """What the config asks of the model itself (built on the meta device): text rows
        within its positions, packed text only where its documents can be kept apart
        (lm_inputs)."""
        check_max_length(cfg, position_limit(model))
        check_packing(cfg, model.config.model_type, PACKS_DOCUMENTS)

    def check_staged(self, cfg: RunConfig, data_dir: Path, manifest: dict,
                     field=None, new_tokens: int = 0) -> None:
        """Every staged token id has a row in the model's embedding, and every row (with
        `new_tokens` generated) a position (lm_inputs). The model is built on the meta
        device only for rows longer than config.json's max_position_embeddings."""
        config = hf_config(weights_dir(cfg.model.name)).get_text_config()
        check_token_ids(cfg, data_dir, manifest, int(config.vocab_size), field, PAD,
                        IGNORE_INDEX)
        need = positions_needed(data_dir, manifest, field, new_tokens, PAD)
        limit = None
        if need and need[2] > (getattr(config, "max_position_embeddings", None) or need[2]):
            with torch.device("meta"):
                limit = position_limit(bare_lm(cfg.model.name))
        check_row_lengths(cfg, manifest, field, new_tokens, need, limit)

    def load_code(self, cfg: RunConfig) -> None:
        import transformers  # noqa: F401  (its kernel choices, as the model will see them)

    def worker_imports(self, cfg: RunConfig) -> tuple[str, ...]:
        return LM_WORKER_IMPORTS

    def stages_text(self, cfg: RunConfig) -> bool:
        return is_text_data(cfg.data)

    def read_dirs(self, cfg: RunConfig) -> list[Path]:
        """The weights directory, and a tokenizer directory of its own where one is set."""
        dirs = [weights_dir(cfg.model.name)]
        if cfg.data.tokenizer:
            dirs.append(Path(cfg.data.tokenizer).expanduser().resolve())
        return dirs

    def build(self, cfg: RunConfig, input_shape: tuple = (), n_outputs: int = 0) -> CausalLM:
        """On the current default device, weights random (meta in the workers): the caller
        loads the base weights."""
        return CausalLM(bare_lm(cfg.model.name))

    def bind_data(self, model: CausalLM, manifest: dict) -> None:
        """Text staged with packing: the EOS that ends each document, so that documents
        sharing a row do not attend to one another. Not for chats (a chat template may end
        every turn with EOS, and a turn must see the ones before it), nor token arrays given
        by the user (rows of one sequence each)."""
        text = manifest.get("text") or {}
        eos = text.get("eos_token_id")
        if text.get("packing") is not True or text.get("messages_field") or eos is None:
            return
        if type(eos) is not int or eos < 0:  # the run directory is untrusted input
            raise UserError(f"data/manifest.json: text.eos_token_id {str(eos)[:40]!r} is not a "
                            "token id, so packed documents cannot be kept apart; the staged "
                            "data were changed after staging: prepare the run again")
        model.document_end = eos

    def weights_dir(self, cfg: RunConfig) -> Optional[Path]:
        return weights_dir(cfg.model.name)

    def output_shape(self, cfg: RunConfig, manifest: dict,
                     generate: Optional[dict] = None) -> list[int]:
        """Scores ([mean log-likelihood, tokens]) or the generated tokens."""
        return [generate["max_new_tokens"]] if generate else [2]

    def generation(self, cfg: RunConfig, new_tokens: Optional[int],
                   seed: Optional[int]) -> Optional[dict]:
        """None scores rows; N continues each by up to N tokens, greedy or sampled with
        `seed` (pure but for the model's config.json)."""
        if new_tokens is None:
            if seed is not None:
                raise UserError("--seed: samples only with --generate N; add --generate")
            return None
        if not 1 <= new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"--generate: {new_tokens} must be between 1 and {MAX_NEW_TOKENS}")
        if seed is not None and not 0 <= seed < 2**31:
            raise UserError(f"--seed: {seed} must be between 0 and {2**31 - 1}")
        folder = weights_dir(cfg.model.name)
        ends = end_token_ids(folder)
        if seed is not None:
            check_sampling(folder)
        return {"max_new_tokens": int(new_tokens), "seed": seed, "eos_token_id": ends}

    def predict(self, model, xb, request: dict, first_row: int, sharded: bool = False):
        gen = request.get("generate")
        if gen and sharded:
            return generate_in_step(model, xb, int(gen["max_new_tokens"]),
                                    gen.get("eos_token_id"))
        if gen:
            return generate(model, xb, int(gen["max_new_tokens"]), gen.get("seed"), first_row,
                            gen.get("eos_token_id"))
        return score(model, xb)

    def describe(self, cfg: RunConfig, model, input_shape: tuple = ()) -> str:
        total = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return f"{cfg.model.name} builds ({total} parameters, {trained} trained)"

    def meta_shape(self, cfg: RunConfig, data_shape=None):
        """From config.json alone: the model built on the meta device (no weights read);
        tokens 0: a row is data.max_length tokens."""
        with torch.device("meta"):
            model = bare_lm(cfg.model.name)
        return self.shape_of(cfg, model)

    def shape_of(self, cfg: RunConfig, model):
        """The memory plan's ModelShape of `model` (the transformers model)."""
        config = model.config.get_text_config()
        vocab = int(config.vocab_size)
        chunk = loss_chunk_tokens(vocab) if CausalLM(model).loss_in_forward else 0
        return measure(model, decoder_layers(model), int(config.hidden_size), 0, vocab,
                       loss_chunk_tokens=chunk, units=shard_units(CausalLM(model)))

    def uses_data_shape(self) -> bool:
        return False


class LoraKind(CausalLMKind):
    """LoRA adapters (peft) over a frozen causal LM: the checkpoints hold the adapters, the
    base weights are read from the weights directory at every start."""

    name = "lora"
    export_formats = ("hf", "peft")

    def worker_imports(self, cfg: RunConfig) -> tuple[str, ...]:
        return (*LM_WORKER_IMPORTS, "peft")

    def check_built(self, cfg: RunConfig, model) -> None:
        super().check_built(cfg, model)
        lora_targets(model, cfg.lora, decoder_layers(model))

    def shape_of(self, cfg: RunConfig, model):
        """The base model's shape, and the names the adapters go on (the memory plan counts
        their parameters)."""
        from dataclasses import replace

        return replace(super().shape_of(cfg, model),
                       lora_targets=tuple(lora_targets(model, cfg.lora, decoder_layers(model))))

    def build(self, cfg: RunConfig, input_shape: tuple = (), n_outputs: int = 0) -> CausalLM:
        """peft's LoRA on the target modules, every base parameter frozen."""
        return CausalLM(with_lora(bare_lm(cfg.model.name), cfg.lora))

    def describe(self, cfg: RunConfig, model, input_shape: tuple = ()) -> str:
        return super().describe(cfg, model, input_shape)[:-1] + f", LoRA r={cfg.lora.r})"


CAUSAL_LM, LORA = CausalLMKind(), LoraKind()
