"""A causal LM's inputs as users give them, judged before anything is written (the client)
or built (the workers): LoRA targets that name layers of the model LoRA adapts, staged
token ids that its embedding holds, rows no longer than the positions a model with
learned positions has (GPT-2's, OPT's), and packed text only for a model that keeps the
documents apart. One line each, naming the field and the fix, where they were an error on
every rank (or, for packing, trained silently on documents that saw each other)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from torch import nn

from enn_cluster.config.lm_config import HF_PREFIX, LoraConfig, is_text_data, peft_matches
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError


def lora_targets(lm: nn.Module, lora: LoraConfig, layers: list[nn.Module]) -> list[str]:
    """The module names peft adapts (its `target_modules`), one value for the adapters, the
    memory plan and the peft export: lora.target_modules as given, every name checked
    (check_lora_targets); or for a word (LORA_TARGET_WORDS) the linear layers inside the
    decoder `layers`' attention modules (`attention`) or inside the layers (`all-linear`),
    each by the shortest end of its name that matches no other module. The client asks
    this of the model built on the meta device, before anything is submitted."""
    if not isinstance(lora.target_modules, str):
        check_lora_targets(lm, lora)
        return list(lora.target_modules)
    inside = set()
    for layer in layers:
        within = layer if lora.target_modules == "all-linear" else _attention(layer)
        inside |= {id(m) for m in within.modules() if _linear(m)} if within is not None else set()
    if not inside:
        raise UserError(f"lora.target_modules: {type(lm).__name__} has no attention module "
                        "with linear layers in its decoder layers; name the layers instead, "
                        f"from {_linear_names(lm)}")
    named = [(n, m) for n, m in lm.named_modules() if _adaptable(m)]
    targets = []
    for name in (n for n, m in named if id(m) in inside):
        parts = name.split(".")  # the shortest end that is theirs (the whole name is)
        end = next(e for e in (".".join(parts[-k:]) for k in range(1, len(parts) + 1))
                   if all(id(m) in inside for n, m in named if peft_matches(n, e)))
        if end not in targets:
            targets.append(end)
    return targets


def _attention(layer: nn.Module):
    """A decoder layer's attention: the outermost module named as one (LlamaAttention,
    GPTNeoXAttention, GPT2Attention, ...) that holds linear layers; None when none does
    (a state-space layer)."""
    for _, m in layer.named_modules():
        if "Attention" in type(m).__name__ and any(_linear(d) for d in m.modules()):
            return m
    return None


def _linear(module: nn.Module) -> bool:
    return _adaptable(module) and not isinstance(module, nn.Embedding)


def _linear_names(lm: nn.Module) -> str:
    """The model's linear layers by their own names, as a refusal offers them."""
    names = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if _linear(m)}
    return ", ".join(sorted(names))[:200]


def check_lora_targets(lm: nn.Module, lora: LoraConfig) -> None:
    """Every target names (as peft matches it: the module's name or its end, after a dot) a
    layer of the model that LoRA adapts (a linear, embedding or convolution layer: peft
    refuses a norm or a whole block)."""
    def hits(target: str, adaptable: bool) -> bool:
        return any(peft_matches(n, target) and (_adaptable(m) or not adaptable)
                   for n, m in lm.named_modules())

    wrong = [t for t in lora.target_modules if not hits(t, True)]
    if wrong:
        what = "name no layer LoRA adapts (a linear, embedding or convolution layer)" \
            if any(hits(t, False) for t in wrong) else "match no module of the model"
        raise UserError(f"lora.target_modules: {wrong} {what}; pick from its linear layers "
                        f"({_linear_names(lm)})")


def _adaptable(module: nn.Module) -> bool:
    """A layer peft's LoRA wraps (transformers' Conv1D, GPT-2's linear, by name)."""
    return isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)) \
        or type(module).__name__ == "Conv1D"


def check_token_ids(cfg: RunConfig, data_dir: Path, manifest: dict, vocab: int, field,
                    pad: int, ignore: int) -> None:
    """Every staged token id has a row of the embedding (`vocab`, its config.json's
    vocab_size): a tokenizer of another vocabulary, or token arrays past it, raised an
    IndexError (a device assert on GPUs) on every rank. `field`: the input the arrays came
    from (a prediction's, whose rows may be padded with `pad`), else the data paths by
    array name (whose labels may be `ignore`, the id the loss skips)."""
    entries = manifest["entries"]
    for split in ("train", "eval"):  # token arrays: one label per input token
        x, y = entries.get(f"{split}_x"), entries.get(f"{split}_y")
        if field is None and x and y and list(x["shape"]) != list(y["shape"]):
            key = "data.train_targets_path" if split == "train" else "data.eval_targets_path"
            raise UserError(f"{key}: {split}_y has shape {tuple(y['shape'])} but {split}_x "
                            f"{tuple(x['shape'])}; a causal LM's labels are one id per input "
                            "token (the model shifts them): give arrays of the same shape")
    also = {name: pad if field is not None else ignore
            for name in entries if field is not None or name.endswith("_y")}
    bad = token_ids_outside(data_dir, entries, vocab, also)
    if bad is None:
        return
    name, value = bad
    text = manifest.get("text")
    if text and not value.startswith("dtype") and not cfg.data.tokenizer:
        raise UserError(f"model.name: the model's own tokenizer in {text['tokenizer']} gives "
                        f"token id {value}, past its vocabulary (vocab_size {vocab} in "
                        "config.json): tokens were added to the tokenizer (a pad, chat "
                        "markers) but not to the embedding; save the model again after "
                        "model.resize_token_embeddings(len(tokenizer))")
    if text and not value.startswith("dtype"):
        raise UserError(f"data.tokenizer: the tokenizer in {text['tokenizer']} gives token id "
                        f"{value}, past the model's vocabulary (vocab_size {vocab} in "
                        f"{cfg.model.name[len(HF_PREFIX):]}/config.json); use the model's own "
                        "tokenizer (leave data.tokenizer out) or one of its vocabulary")
    if field is None:
        field = _data_key(name)
        if name.endswith("_y") and cfg.data.train_targets_path and name.startswith("train"):
            field = "data.train_targets_path"
    what = (f"holds {value}, not token ids" if value.startswith("dtype") else
            f"holds token id {value}, past the model's vocabulary (vocab_size {vocab})")
    skipped = (f"{pad} pads a row" if also.get(name) == pad and field is not None else
               f"labels may be {ignore}, which the loss skips")
    raise UserError.on(field, f"{name} {what}",
                       f"give integer ids from 0 to {vocab - 1} ({skipped})")


def position_limit(lm: nn.Module) -> Optional[tuple[int, str]]:
    """The positions a model with learned absolute positions has a row for (GPT-2's `wpe`,
    OPT's and BioGPT's tables past their offset), and the config.json key that says so
    (`n_positions` for GPT-2): max_position_embeddings, when an embedding other than the
    token embedding has that many rows. None for rotary and ALiBi models, which take rows
    of any length (past their training length, at the user's choice)."""
    config = lm.config.get_text_config()
    n = getattr(config, "max_position_embeddings", None)
    if type(n) is not int:
        return None
    tokens = lm.get_input_embeddings()
    tables = [m.num_embeddings - int(getattr(m, "offset", 0) or 0) for m in lm.modules()
              if isinstance(m, nn.Embedding) and m is not tokens]
    key = type(config).attribute_map.get("max_position_embeddings", "max_position_embeddings")
    return (n, key) if n in tables else None


def positions_needed(data_dir: Path, manifest: dict, field, new_tokens: int,
                     pad: int) -> Optional[tuple[str, int, int]]:
    """(array name, its row width, the positions its longest row needs) of the staged rows
    needing the most: a row's width (training, scoring: padding is forwarded too), or with
    `new_tokens` generated, the longest prompt (its ids other than `pad`) and every new
    token but the last (never fed back). None when nothing is staged as rows."""
    best = None
    for name in sorted(manifest["entries"]):
        if field is None and not name.endswith("_x"):
            continue  # labels: as wide as their inputs (check_token_ids)
        arr = np.load(data_dir / f"{name}.npy", mmap_mode="r")
        if arr.ndim != 2:
            continue
        width = need = int(arr.shape[1])
        if new_tokens:
            longest = max((int((np.asarray(arr[i:i + 65536]) != pad).sum(axis=1).max())
                           for i in range(0, len(arr), 65536)), default=0)
            need = longest + new_tokens - 1
        if best is None or need > best[2]:
            best = (name, width, need)
    return best


def check_max_length(cfg: RunConfig, limit: Optional[tuple[int, str]]) -> None:
    """Text is staged in rows of data.max_length tokens: no more than the positions of a
    model with learned positions (`limit`: position_limit's), refused before anything is
    staged."""
    if limit is not None and is_text_data(cfg.data) and cfg.data.max_length > limit[0]:
        raise UserError(f"data.max_length: {cfg.data.max_length} tokens is more than the "
                        f"model's {_positions(cfg, limit)}; set data.max_length to "
                        f"{limit[0]} or less")


def check_packing(cfg: RunConfig, model_type: str, packs: frozenset) -> None:
    """Packed plain text (not chats: their turns see each other by design) only for the
    architectures that keep packed documents apart (`packs`): elsewhere each document would
    attend to the ones before it in its row, silently."""
    if is_text_data(cfg.data) and cfg.data.packing and not cfg.data.messages_field \
            and model_type not in packs:
        raise UserError(f"data.packing: a {model_type} model does not keep packed documents "
                        "apart (its attention does not restart at a document's end), so each "
                        "would attend to the ones before it in its row; set data.packing: "
                        "false (one document per row)")


def _data_key(name: str) -> str:
    """The config key a staged array (`train_x`, `eval_y`) came from."""
    return "data.eval_path" if name.startswith("eval") else "data.train_path"


def _positions(cfg: RunConfig, limit: tuple[int, str]) -> str:
    return (f"{limit[0]} positions ({limit[1]} in {cfg.model.name[len(HF_PREFIX):]}/"
            "config.json: it learns one embedding per position)")


def check_row_lengths(cfg: RunConfig, manifest: dict, field, new_tokens: int,
                      need: Optional[tuple[str, int, int]],
                      limit: Optional[tuple[int, str]]) -> None:
    """Token arrays no wider than data.max_length (the memory plan counts rows of that many
    tokens), and rows within the `limit` positions of a model with learned positions
    (position_limit: an IndexError on every rank, a device assert on GPUs). `need`:
    positions_needed's answer; `field`: as for check_token_ids."""
    if need is None:
        return
    name, width, positions = need
    if field is None and not manifest.get("text") and width > cfg.data.max_length:
        raise UserError(f"{_data_key(name)}: {name} has rows of {width} tokens, more than "
                        f"data.max_length ({cfg.data.max_length}), the row length the memory "
                        f"plan counts; set data.max_length: {width}, or cut the rows")
    if limit is None or positions <= limit[0]:
        return
    if new_tokens:
        prompt = positions - new_tokens + 1
        raise UserError(f"--generate: the longest prompt ({prompt} tokens) and {new_tokens} new "
                        f"tokens need {positions} positions, more than the model's "
                        f"{_positions(cfg, limit)}; generate at most "
                        f"{max(limit[0] - prompt + 1, 0)} tokens, or shorten the prompts")
    raise UserError.on(field or _data_key(name), f"{name} has rows of {width} tokens, more "
                       f"than the model's {_positions(cfg, limit)}",
                       f"cut the rows to {limit[0]} tokens or less")


def token_ids_outside(data_dir: Path, entries: dict, vocab: int, also: dict,
                      block_rows: int = 65536) -> Optional[tuple[str, str]]:
    """The first staged array of token ids holding what an embedding of `vocab` rows cannot
    take: (array name, the value, or its dtype when it is not an integer type). `also`:
    array name -> the one negative value it may hold besides. None when every id fits. One
    pass over the staged memmaps."""
    for name in sorted(entries):
        arr = np.load(data_dir / f"{name}.npy", mmap_mode="r")
        if not np.issubdtype(arr.dtype, np.integer):
            return name, f"dtype {arr.dtype}"
        for start in range(0, len(arr), block_rows):
            block = np.asarray(arr[start:start + block_rows])
            ok = (block >= 0) & (block < vocab)
            if name in also:
                ok |= block == also[name]
            if not ok.all():
                return name, str(int(block[~ok].flat[0]))
    return None
