"""Model kinds: one object per kind of model, which the rest of the package asks instead of
branching on the model's name (torchtitan's ModelSpec, for the questions our runtime asks).

A kind answers, for a run's config:
- `check`: can this machine run it (the client's check before anything is written);
- `stages_text`: are its training files text, tokenized once into token memmaps;
- `read_dirs`: what the workers read besides the run directory (mounted read-only in the
  container);
- `build`: the model, on the current default device (the workers build on meta);
- `bind_data`: what the staged data's manifest tells the built model (packed documents);
- `weights_dir`: the files its base weights are read from into the sharded model (None:
  initialised by meta_init's rules or its own `init_weights`, or read from a checkpoint);
- `output_shape`, `predict`, `generation`, `predicts_sharded`, `compares_fp32`: what a
  prediction computes and how it is checked;
- `export_formats`: what `export --format` offers besides every model's `torch` and
  `export`;
- `meta_shape`: the memory plan's view of the model (built on the meta device);
- `describe`: doctor's line for it.
What a built module answers itself stays on the module (duck typing, as torchtitan's models
do): `blocks()` (the FSDP units), `loss()`, `input_dtype`, `init_weights()`.

The kinds: ArraysKind (built-in models and `module:factory`, models/__init__.py),
CausalLMKind and LoraKind (models/causal_lm.py); `models.kind_of(cfg)` picks one. A kind of a user's own is named by `model.name:
package.module:KindClass` (a ModelKind subclass) and needs no edit anywhere else
(tests/toy_kind.py is one).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError
from enn_cluster.models.factory import check_factory, import_factory  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # torch is imported where a model is built, not with this module
    from torch import nn


class ModelKind:
    """The contract; the defaults are the answers of a model fed arrays of values."""

    name = "arrays"
    export_formats: tuple = ()  # formats of its own, beside every model's torch and export
    predicts_sharded = False  # `predict --sharded`: the model sharded over the ranks
    compares_fp32 = True  # a bf16 prediction re-runs its first batch in fp32 to compare
    same_row_shape = True  # a prediction's rows have the training rows' shape (else: ndim)

    def check(self, cfg: RunConfig) -> None:
        """What the client checks before anything is written (one UserError line)."""

    def check_staged(self, cfg: RunConfig, data_dir: Path, manifest: dict,
                     field=None, new_tokens: int = 0) -> None:
        """What the staged data must hold for this model, checked before the run directory
        (or a prediction's) is put in place: one UserError line naming `field`, the input
        the arrays came from, else the data paths; `new_tokens`: a prediction's rows are
        continued by that many (a causal LM's --generate)."""

    def load_code(self, cfg: RunConfig) -> None:
        """Import the code the model runs (a worker does before it reports its kernels: an
        import may switch process-wide kernels, such as SDPA's backends)."""
        if ":" in cfg.model.name:
            import_factory(cfg.model.name)

    def worker_imports(self, cfg: RunConfig) -> tuple[str, ...]:
        """The libraries its workers import, which a forking local launcher imports once for
        them (a user's own code is not among them: each worker imports it, as on Slurm)."""
        return ()

    def stages_text(self, cfg: RunConfig) -> bool:
        """Whether the training data are text files, tokenized at staging."""
        return False

    def read_dirs(self, cfg: RunConfig) -> list[Path]:
        """Directories the workers read besides the run directory."""
        return []

    def build(self, cfg: RunConfig, input_shape: tuple, n_outputs: int):
        """The model on the current default device (weights random or empty)."""
        raise NotImplementedError

    def bind_data(self, model, manifest: dict) -> None:
        """Tell the built model what the staged data's manifest says it must know to train
        on them (a causal LM: where packed documents end); nothing by default."""

    def weights_dir(self, cfg: RunConfig) -> Optional[Path]:
        """The directory whose files hold the base weights (None: no such files)."""
        return None

    def output_shape(self, cfg: RunConfig, manifest: dict,
                     generate: Optional[dict] = None) -> list[int]:
        """A prediction row's shape: a training target's (or the class logits)."""
        if cfg.model.task == "classification":
            return [int(manifest.get("n_classes", 2))]
        return list(manifest["entries"]["train_y"]["shape"][1:])

    def generation(self, cfg: RunConfig, new_tokens: Optional[int],
                   seed: Optional[int]) -> Optional[dict]:
        """The request's `generate` entry for `predict --generate N` (None: values)."""
        if new_tokens is None and seed is None:
            return None
        flag = "--generate" if new_tokens is not None else "--seed"
        raise UserError(f"{flag}: only a causal LM generates; {cfg.model.name} is a "
                        f"{cfg.model.task} model")

    def predict(self, model, xb, request: dict, first_row: int, sharded: bool = False):
        """One batch's outputs (a tensor: rows first)."""
        return model(xb)

    def describe(self, cfg: RunConfig, model, input_shape: tuple) -> str:
        """doctor's line for a model that builds."""
        n = sum(p.numel() for p in model.parameters())
        return f"{cfg.model.name} builds ({n} parameters, input {input_shape})"

    def meta_shape(self, cfg: RunConfig, data_shape: Callable[[], tuple]):
        """The memory plan's ModelShape of the model built on the meta device.
        `data_shape()`: (input shape of a row, outputs) as staging will find them. A row is
        one token; the activations' width is the widest Linear's."""
        import torch

        input_shape, n_outputs = data_shape()
        with torch.device("meta"):
            model = self.build(cfg, input_shape, n_outputs)
        widths = [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
        return measure(model, model_blocks(model), max(widths, default=1), 1, 0)

    def uses_data_shape(self) -> bool:
        """Whether `meta_shape` needs the data's shape (an API run's arrays are known only
        when staged: its plan is left to the run)."""
        return True


class ArraysKind(ModelKind):
    """The built-in models (mlp, transformer) and `module:factory` models, fed arrays (a
    factory's module is imported, and so checked, by kind_of)."""

    def check(self, cfg: RunConfig) -> None:
        """A factory takes the keywords it will be called with."""
        if ":" in cfg.model.name:
            from enn_cluster.models.factory import check_call

            check_call(cfg.model.name, cfg.model.kwargs)

    def build(self, cfg: RunConfig, input_shape: tuple, n_outputs: int):
        from enn_cluster.models.builtin import build_model

        return build_model(cfg.model, input_shape, n_outputs)

    def meta_shape(self, cfg: RunConfig, data_shape):
        import math

        import torch
        from torch import nn

        from enn_cluster.models.builtin import FeatureTransformer

        input_shape, n_outputs = data_shape()
        with torch.device("meta"):
            model = self.build(cfg, input_shape, n_outputs)
        widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
        if isinstance(model, FeatureTransformer):
            tokens, hidden = (input_shape[0] if len(input_shape) == 2 else math.prod(input_shape),
                              cfg.model.d_model)
        else:
            tokens, hidden = 1, max(widths, default=1)
        return measure(model, model_blocks(model), hidden, tokens, 0)


ARRAYS = ArraysKind()


def model_blocks(model: "nn.Module") -> list:
    """The units FSDP shards one by one: the model's own `blocks()`, else its repeated
    layers (`repeated_blocks`), else its top-level children that train."""
    if hasattr(model, "blocks"):
        return list(model.blocks())
    return repeated_blocks(model) or [
        m for m in model.children() if any(p.requires_grad for p in m.parameters())]


def shard_units(model: "nn.Module") -> list:
    """FSDP's units, in forward order, each all-gathered only while it computes (the root
    holds the rest whole for the whole step): the model's `leading_units()` (a causal LM's
    token embedding, a vocabulary x hidden matrix) then its blocks, less any whose weights
    something outside it uses too (own_parameters_only)."""
    lead = list(model.leading_units()) if hasattr(model, "leading_units") else []
    return own_parameters_only(model, lead + model_blocks(model))


def own_parameters_only(model: "nn.Module", units: list) -> list:
    """The units whose parameters nothing outside them uses. FSDP2 puts a parameter in one
    group only: a weight tied across units (a decoder to its encoder, a head to the
    embedding) would be claimed by two ("shared with a parameter already managed by another
    FSDP group"), so the units holding it are left to the root's group. Pure."""
    from collections import Counter

    everywhere = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [unit for unit in units
            if all(everywhere[pid] == n for pid, n in Counter(
                id(p) for _, p in unit.named_parameters(remove_duplicate=False)).items())]


def repeated_blocks(model: "nn.Module") -> list:
    """The layers a model repeats, found in the model itself (pure): the classes a Hugging
    Face model names in `_no_split_modules` (its decoder layer), wherever it sits in a user's
    wrapper; else the ModuleList of two or more modules of one class holding the most
    parameters. [] when there is neither."""
    from torch import nn

    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    lists = [lst for lst in model.modules() if isinstance(lst, nn.ModuleList) and len(lst) > 1
             and len({type(m) for m in lst}) == 1]
    if not lists:
        return []
    return list(max(lists, key=lambda lst: sum(p.numel() for p in lst.parameters())))


def measure(model, blocks: list, hidden: int, tokens: int, vocab: int, **extra):
    """The ModelShape of a model built on the meta device (no memory, no weights); FSDP's
    units are `shard_units(model)`, or `units=` for a model that is not the one trained
    (a causal LM's bare transformers model)."""
    from torch import nn

    from enn_cluster.config.memory_plan import ModelShape

    units = extra.pop("units", None)
    units = shard_units(model) if units is None else units
    params = sum(p.numel() for p in model.parameters())
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    unit_params = [sum(p.numel() for p in u.parameters()) for u in units]
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, nn.Linear))
    intermediate, gated = _mlp_width(blocks[0] if blocks else model, hidden)
    return ModelShape(params=params, layers=max(len(blocks), 1), hidden=hidden, tokens=tokens,
                      vocab=vocab, largest_unit=max(unit_params + [params - sum(unit_params)]),
                      largest_layer=max(block_params, default=0), linears=linears,
                      intermediate=intermediate, gated=gated, **extra)


def _mlp_width(block, hidden: int) -> tuple[int, bool]:
    """The MLP of a layer: the widest Linear hidden -> i that a Linear i -> hidden brings
    back; gated (SwiGLU) when two such Linears feed it. (0, False) when none is found."""
    from torch import nn

    shapes = [(m.in_features, m.out_features) for m in block.modules() if isinstance(m, nn.Linear)]
    wide = [o for i, o in shapes if i == hidden and o > hidden and (o, hidden) in shapes]
    width = max(wide, default=0)
    return width, wide.count(width) >= 2



def quiet_library_logs() -> None:
    """No import-time log lines from torchao in our processes: transformers imports it
    whenever it is installed (the float8 extra), for every model it builds, and it logs the
    kernels it could not load for this torch build, its missing triton, and (through torch)
    a deprecation notice for its enums. They reached the stderr of every LM command, above
    the one line a refusal prints, about nothing we use (float8 logs its own line). Errors
    still pass. Called by the CLI and the workers, not by the API in a user's process."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
