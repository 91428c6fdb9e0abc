"""A causal LM's inputs as users give them, judged before anything is written (the client)
or built (the workers): LoRA targets that name layers of the model LoRA adapts, and staged
token ids that its embedding holds. One line each, naming the field and the fix, where
they were an error on every rank."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from torch import nn

from enn_cluster.config.lm_config import HF_PREFIX, LoraConfig
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError


def check_lora_targets(lm: nn.Module, lora: LoraConfig) -> None:
    """Every target names (as peft matches it: the module's name or its end, after a dot) a
    layer of the model that LoRA adapts (a linear, embedding or convolution layer: peft
    refuses a norm or a whole block). The client asks this of the model built on the meta
    device, so that a typo is refused before anything is submitted."""
    def hits(target: str, adaptable: bool) -> bool:
        return any((n == target or n.endswith("." + target)) and (_adaptable(m) or not adaptable)
                   for n, m in lm.named_modules())

    wrong = [t for t in lora.target_modules if not hits(t, True)]
    if wrong:
        linear = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules()
                  if _adaptable(m) and not isinstance(m, nn.Embedding)}
        what = "name no layer LoRA adapts (a linear, embedding or convolution layer)" \
            if any(hits(t, False) for t in wrong) else "match no module of the model"
        raise UserError(f"lora.target_modules: {wrong} {what}; pick from its linear layers "
                        f"({', '.join(sorted(linear))[:200]})")


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
    if text and not value.startswith("dtype"):
        raise UserError(f"data.tokenizer: the tokenizer in {text['tokenizer']} gives token id "
                        f"{value}, past the model's vocabulary (vocab_size {vocab} in "
                        f"{cfg.model.name[len(HF_PREFIX):]}/config.json); use the model's own "
                        "tokenizer (leave data.tokenizer out) or one of its vocabulary")
    if field is None:
        field = "data.eval_path" if name.startswith("eval") else "data.train_path"
        if name.endswith("_y") and cfg.data.train_targets_path and name.startswith("train"):
            field = "data.train_targets_path"
    what = (f"holds {value}, not token ids" if value.startswith("dtype") else
            f"holds token id {value}, past the model's vocabulary (vocab_size {vocab})")
    skipped = (f"{pad} pads a row" if also.get(name) == pad and field is not None else
               f"labels may be {ignore}, which the loss skips")
    raise UserError.on(field, f"{name} {what}",
                       f"give integer ids from 0 to {vocab - 1} ({skipped})")


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
