"""`export --format hf` streamed: a causal LM's checkpoint written as the Hugging Face
directory save_pretrained would write, one tensor at a time, never the whole model.

Why: building the model to call save_pretrained holds every weight in fp32 (about 280 GB
for a 70B model). Here the model exists on the meta device only, for its names, shapes,
tied pairs and LoRA layers. Each shard file's header is written first; then each of its
tensors is read when its turn comes, cast to the dtype asked (the base's by default) and
appended. A trained tensor comes from the DCP checkpoint (`safe_load` of a group of at
most one shard's bytes, then the next group); a frozen one from the weights folder's
safetensors (`safe_open`, that tensor alone), with a LoRA layer's delta added in fp32 as
peft's `merge_and_unload` adds it. Peak memory: one read group plus one tensor.
The files are save_pretrained's: `model.safetensors`, or `model-0000k-of-0000n.safetensors`
and `model.safetensors.index.json`; a tied pair once, under its first name (the embedding);
config.json says the dtype written.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from enn_cluster.config.hf_name import weights_dir
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.models import kind_of
from enn_cluster.models.causal_lm import ADAPTER, hf_config
from enn_cluster.models.safetensors_header import CODES, encode_header, tensors
from enn_cluster.models.weight_names import folder_names, hf_name, is_adapter
from enn_cluster.storage.dcp_io import safe_load
from enn_cluster.storage.dcp_metadata import tensor_specs

DTYPES = ("bfloat16", "float16", "float32")  # what --dtype writes
SHARD_BYTES = 5 * 10**9  # huggingface_hub's default max shard size ("5GB")
_FLOATS = {CODES[d]: d for d in ("float64", "float32", "float16", "bfloat16")}
_DTYPE_OF = {code: name for name, code in CODES.items()}  # safetensors code -> torch name
_LORA_BASE = ".base_layer.weight"


@dataclass(frozen=True)
class Entry:
    """One tensor of the written files and where its values come from."""
    name: str  # in the written files (the weights folder's name)
    dtype: str  # written (torch dtype name)
    shape: tuple
    source: str  # our name in the checkpoint, or "" (the weights folder's file)
    lora: str = ""  # the LoRA layer whose delta is added (module name), or ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def pack(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` cut into runs of at most `budget` bytes, in order, one larger item
    alone (where it comes): huggingface_hub's split of a state dict into shards. Pure."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if size > budget:
            runs.append([i])
            continue
        if total + size > budget:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    return runs + [current] if current else runs


def shard_files(count: int) -> list[str]:
    """save_pretrained's file names for `count` shards. Pure."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def base_dtype(weights: Path, base: Optional[dict] = None) -> str:
    """The dtype the weights folder holds: config.json's, else the safetensors' floating
    tensors' (most bytes), else float32. `base`: its `tensors`, when already read."""
    said = str(getattr(hf_config(weights), "dtype", None) or "").removeprefix("torch.")
    if said in DTYPES:
        return said
    count: dict = {}
    held = base if base is not None else tensors(weights)
    for found in held.values():
        if found.dtype in _FLOATS:
            code = _FLOATS[found.dtype]
            count[code] = count.get(code, 0) + math.prod(found.shape)
    return max(count, key=count.get) if count else "float32"


def plan_entries(model: nn.Module, specs: dict, base: dict, dtype: str) -> list[Entry]:
    """The written tensors of `model` (meta), in its state dict's order: a tied pair once,
    under its first name (the weights folder's: weight_names); adapters merged, never
    written. Floating ones in `dtype`."""
    renamed = folder_names(model, base)
    aliases: dict = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not is_adapter(name):
            aliases.setdefault(id(tensor), []).append((name, tensor))
    out = []
    for names in aliases.values():
        name, tensor = names[0]
        source = next((n for n, _ in names if n in specs), "")
        hf = renamed.get(hf_name(name), hf_name(name))
        if source and specs[source][0] != tuple(tensor.shape):
            raise UserError.on(INPUTS["step"], f"the checkpoint's {source} has shape "
                               f"{list(specs[source][0])}, but the model needs "
                               f"{list(tensor.shape)}; it was not written by this run's model")
        if not source and hf not in base:
            raise UserError(f"model.name: no safetensors file of the weights folder holds "
                            f"{hf}, and the checkpoint does not either; restore the files "
                            "save_pretrained wrote")
        floating = specs[source][1].is_floating_point if source else base[hf].dtype in _FLOATS
        own = str(specs[source][1]).removeprefix("torch.") if source else \
            _DTYPE_OF.get(base[hf].dtype, "float32")
        lora = name.removesuffix(_LORA_BASE) if name.endswith(_LORA_BASE) else ""
        out.append(Entry(hf, dtype if floating else own, tuple(tensor.shape), source, lora))
    return out


def check_held(model, held: set, lora: bool, step_dir: Path) -> None:
    """The checkpoint's model tensors (`held`, names less "model.") are this model's: all
    of them its own, every one it trains among them."""
    have = held & set(model.state_dict(keep_vars=True))
    trained = {n for n, _ in model.named_parameters() if not lora or is_adapter(n)}
    if not have or len(have) != len(held) or not trained <= held:
        raise UserError("{value} holds {held} model tensors, {had} of which this model has, "
                        "and lacks {lacks} it trains; it was not written by this run's model",
                        field=INPUTS["step"], value=step_dir, held=len(held), had=len(have),
                        lacks=len(trained - held))


class CheckpointReader:
    """The checkpoint's tensors, loaded a group at a time (the group of the tensor asked
    for), each handed out once and then dropped: taken in the order the groups were cut,
    at most one group is held (with a tensor larger than a group, in its own)."""

    def __init__(self, step_dir: Path, specs: dict, groups: list[list[str]]) -> None:
        self.step_dir, self.specs, self.groups = step_dir, specs, groups
        self.group_of = {k: g for g, keys in enumerate(groups) for k in keys}
        self.held: dict = {}

    def take(self, key: str) -> torch.Tensor:
        if key not in self.held:
            state = {k: torch.empty(self.specs[k][0], dtype=self.specs[k][1])
                     for k in self.groups[self.group_of[key]]}
            safe_load({"model": state}, self.step_dir)
            self.held.update(state)
        return self.held.pop(key)


def load_adapters(model: nn.Module, step_dir: Path, specs: dict) -> None:
    """Give the meta model's adapters (small) real tensors read from the checkpoint."""
    state = {}
    for name, param in list(model.named_parameters()):
        if is_adapter(name):
            owner, attr = name.rsplit(".", 1)
            real = nn.Parameter(torch.empty(param.shape, dtype=specs[name][1]),
                                requires_grad=False)
            setattr(model.get_submodule(owner), attr, real)
            state[name] = real.detach()
    safe_load({"model": state}, step_dir)


def write_streamed(cfg, step_dir: Path, out: Path, dtype: Optional[str] = None,
                   shard_bytes: int = SHARD_BYTES) -> str:
    """The model's safetensors, index and config.json into `out`; returns the dtype written."""
    from enn_cluster.storage.base_weights import check_step_base

    weights = weights_dir(cfg.model.name)
    base = tensors(weights)  # every header read once
    dtype = dtype or base_dtype(weights, base)
    with torch.device("meta"):
        model = kind_of(cfg).build(cfg)
    specs = tensor_specs(step_dir, "model.")
    check_held(model, set(specs), cfg.lora.enabled, step_dir)
    if cfg.lora.enabled:
        check_step_base(step_dir, weights)
        load_adapters(model, step_dir, specs)
    entries = plan_entries(model, specs, base, dtype)
    shards = [[entries[i] for i in run] for run in pack([e.nbytes for e in entries], shard_bytes)]
    held = [e.source for shard in shards for e in shard if e.source]  # in the order written
    groups = pack([math.prod(specs[k][0]) * specs[k][1].itemsize for k in held], shard_bytes)
    reader = CheckpointReader(step_dir, specs, [[held[i] for i in g] for g in groups])

    def value(e: Entry) -> torch.Tensor:
        if e.source:
            t = reader.take(e.source)
        else:  # each time opened and closed: a file kept mapped stays in the RSS as it is read
            from safetensors import safe_open

            with safe_open(str(base[e.name].file), framework="pt") as fh:
                t = fh.get_tensor(e.name)
        if e.lora:  # peft's merge: the fp32 base += get_delta_weight, then the cast
            t = t.float() + model.get_submodule(e.lora).get_delta_weight(ADAPTER)
        return t.to(getattr(torch, e.dtype))

    names = shard_files(len(shards))
    for file, shard in zip(names, shards):
        write_shard(out / file, shard, value)
    if len(names) > 1:
        index = {"metadata": {"total_parameters": sum(math.prod(e.shape) for e in entries),
                              "total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: f for f, shard in zip(names, shards) for e in shard}}
        (out / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_configs(weights, out, dtype)
    return dtype


def write_shard(path: Path, entries: list[Entry], value) -> None:
    """One safetensors file: the header, then each tensor as `value(entry)` gives it."""
    with open(path, "wb") as fh:
        fh.write(encode_header([(e.name, e.dtype, e.shape, e.nbytes) for e in entries]))
        for e in entries:
            t = value(e)
            if tuple(t.shape) != e.shape or str(t.dtype) != f"torch.{e.dtype}":
                raise UserError(f"model.name: {e.name} reads as {list(t.shape)} {t.dtype}, "
                                f"not the {list(e.shape)} the model needs; restore the "
                                "files save_pretrained wrote")
            fh.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t


def write_configs(weights: Path, out: Path, dtype: str) -> None:
    """config.json saying `dtype`, and generation_config.json as save_pretrained writes
    them (the folder's own generation config when it has one)."""
    from transformers import GenerationConfig

    config = hf_config(weights)
    config.dtype = dtype
    config.save_pretrained(str(out))
    if (weights / "generation_config.json").is_file():
        shutil.copyfile(weights / "generation_config.json", out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(out))
