"""Client side of `predict`, before any worker runs: choose the checkpoint, stage the
input, write the request. No torch.

`predictions/<name>/` appears all at once (staged under a temporary name, then renamed),
so a bad input never leaves a half-made prediction. Asking again for an existing name
continues that prediction; a different input or step under the same name is refused.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from enn_cluster.config.lm_config import TEXT_SUFFIXES
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.storage import commits as store
from enn_cluster.storage import prediction_manifest as pm
from enn_cluster.storage.checksum import algorithm_of, bytes_checksum
from enn_cluster.storage.data_sources import check_source, inspect_array
from enn_cluster.storage.npy_header import check_layout
from enn_cluster.storage.rundir import (
    DIR_MODE,
    RunDir,
    atomic_write_text,
    fsync_dir,
    run_umask,
    sigterm_unwinds,
)
from enn_cluster.storage.staging import read_manifest, stage_array
from enn_cluster.storage.step_choice import choose_step
from enn_cluster.storage.text_sources import check_same_tokenizer, check_text_file
from enn_cluster.storage.text_staging import text_rows

INPUT = INPUTS["input"]  # --input, the API's X

DEFAULT_CHUNK_ROWS = 65536
DEFAULT_BATCH_SIZE = 1024


@dataclass(frozen=True)
class PredictionRequest:
    name: str
    path: Path
    step: int
    complete: bool  # manifest committed: nothing left for workers to do
    fallback: Optional[str] = None  # newer steps passed over (step_choice.fallback_line)


def generation_request(cfg, new_tokens: Optional[int], seed: Optional[int]) -> Optional[dict]:
    """The request's `generate` entry, as the model's kind makes it (None: predict values or
    scores; only a causal LM generates)."""
    from enn_cluster.models import kind_of

    return kind_of(cfg).generation(cfg, new_tokens, seed)


def output_shape(cfg, manifest: dict, generate: Optional[dict] = None) -> list[int]:
    """A prediction row's shape, as the model's kind says (a target's, class logits, an
    LM's scores or generated tokens)."""
    from enn_cluster.models import kind_of

    return kind_of(cfg).output_shape(cfg, manifest, generate)


def default_name(source: Any, step: int, checksum: str) -> str:
    """A file's stem and the step; an in-memory array is named by its content."""
    if isinstance(source, (str, Path)):
        stem = Path(str(source).rstrip("/")).name.rsplit(".", 1)[0]
        stem = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_"
                       for c in stem).lstrip("._-")
        return f"{stem[:100] or 'input'}-step-{step}"
    return f"array-{checksum.rsplit(':', 1)[-1]}-step-{step}"


def _is_text(cfg, source: Any) -> bool:
    """Input given as a text file, for a model whose data is text (tokenized here, like its
    training data)."""
    from enn_cluster.models import kind_of

    return isinstance(source, (str, os.PathLike)) and str(source).endswith(TEXT_SUFFIXES) \
        and kind_of(cfg).stages_text(cfg)


def _check_input(entry: dict, run: RunDir, same_shape: bool) -> None:
    """Rows of the training rows' shape; for a model whose rows may be of any length (a
    causal LM's token ids: `same_shape` False), of as many dimensions."""
    features = read_manifest(run.data_dir)["entries"]["train_x"]["shape"][1:]
    shape = entry["shape"][1:]
    if shape != features and (same_shape or len(shape) != len(features)):
        raise UserError("rows have shape {shape} but the model was trained on rows of shape "
                        "{features}", field=INPUT, shape=tuple(shape), features=tuple(features))
    if entry["shape"][0] < 1:
        raise UserError("has no rows", field=INPUT)


def check_prediction_inputs(run: RunDir, cfg, source: Any) -> None:
    """What both front ends check before anything of a prediction is written: the run's
    control files readable, its model importable here, a named input file usable (an array
    from the API is judged when staged)."""
    from enn_cluster.client.launching import check_control_files
    from enn_cluster.client.prepare import check_model

    check_control_files(run)
    check_model(cfg)
    if isinstance(source, str) and _is_text(cfg, source):
        check_text_file(INPUT, source, cfg.data, need_assistant=False)
    elif isinstance(source, str):
        check_source(INPUT, source)


def prepare_prediction(run: RunDir, source: Any = None, *, name: Optional[str] = None,
                       step: Optional[int] = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                       batch_size: int = DEFAULT_BATCH_SIZE, cfg=None,
                       generate: Optional[dict] = None, sharded: bool = False) -> PredictionRequest:
    """Create (or re-open) `predictions/<name>/` with the staged input and request.json.
    `cfg`: the run's config when the caller has loaded it (else read here)."""
    cfg = run.load_config() if cfg is None else cfg
    if chunk_rows < 1 or batch_size < 1:
        raise UserError("must be >= 1", field=(INPUTS["chunk_rows"], INPUTS["batch_size"]),
                        value=(chunk_rows, batch_size))
    if name is not None:
        _checked_name(name)
    existing = _existing(run, name)
    if existing is not None and source is None:
        if step is not None and step != existing["step"]:
            raise _other_step(name, existing["step"], step)
        return _request(run, existing)
    if isinstance(source, str):
        from enn_cluster.config.run_config import no_credentials_in_url

        no_credentials_in_url(INPUT, source)
    if source is None:
        raise UserError("required (no prediction named {name!r} to continue in {where})",
                        field=INPUT, name=name, where=run.predictions)
    text = _is_text(cfg, source)
    if text:
        check_text_file(INPUT, str(source), cfg.data, need_assistant=False)
    else:
        _check_input_array(source, cfg.data.x_key)
    if existing is not None and step is None:
        step = existing["step"]
    step, fallback = choose_step(run.checkpoints, step)
    if text:  # the tokenizer first: its own refusal says what a changed one does to text
        check_same_tokenizer(read_manifest(run.data_dir).get("text"), cfg.data, cfg.model)
    if cfg.lora.enabled:  # the small files here, before anything is staged; the workers
        # read the safetensors (a login node need not read a base model's every byte)
        from enn_cluster.config.hf_name import weights_dir
        from enn_cluster.storage.base_weights import check_step_base

        check_step_base(store.step_dir(run.checkpoints, step), weights_dir(cfg.model.name),
                        read_weights=False)
    if text:  # tokenized here, staged as the array of token ids it makes
        name = name or default_name(source, step, "")
        source = text_rows(INPUT, str(source), cfg.data, cfg.model)
    with run_umask(), sigterm_unwinds():  # modes as the rest of the run, whatever the umask
        staged = _stage_request(run, cfg, source, name, step, chunk_rows, batch_size,
                                generate, sharded)
    return replace(staged, fallback=fallback)


def _check_input_array(source: Any, x_key: str) -> None:
    """The input's header (a file) or dtype and shape (an array), before anything is made."""
    if isinstance(source, (str, os.PathLike)):
        source = str(source)
        check_source(INPUT, source)
        inspect_array(INPUT, source, x_key if source.endswith(".npz") else None)
    elif isinstance(source, np.ndarray):
        check_layout(INPUT, "the input array", tuple(source.shape), False, source.dtype, None)


def _stage_request(run: RunDir, cfg, source, name: Optional[str], step: int, chunk_rows: int,
                   batch_size: int, generate: Optional[dict] = None,
                   sharded: bool = False) -> PredictionRequest:
    """Stage the input and write the request under a temporary name, then rename it into
    place; the temporary directory goes on every exit path."""
    from enn_cluster.models import kind_of

    tmp = run.predictions / f".staging-{os.getpid()}-{time.time_ns()}"
    run.predictions.mkdir(mode=DIR_MODE, exist_ok=True)
    key = cfg.data.x_key if str(source).endswith(".npz") else None
    tmp.mkdir(mode=DIR_MODE)
    try:
        entry = stage_array(source, tmp / pm.INPUT, key=key, progress=sys.stderr)
        _check_input(entry, run, kind_of(cfg).same_row_shape)
        kind_of(cfg).check_staged(cfg, tmp, {"entries": {pm.INPUT.removesuffix(".npy"): entry}},
                                  field=INPUT,
                                  new_tokens=generate["max_new_tokens"] if generate else 0)
        name = name or default_name(source, step, entry["checksum"])
        final = run.predictions / name
        existing = _existing(run, name)
        if existing is not None:
            return _reuse(run, existing, entry, step)
        manifest = read_manifest(run.data_dir)
        request = {"name": name, "step": step, "input": entry, "chunk_rows": chunk_rows,
                   "batch_size": batch_size,
                   "output_shape": output_shape(cfg, manifest, generate),
                   "scaler": manifest.get("target_scaler"), "created": time.time(),
                   **({"generate": generate} if generate else {}),
                   **({"sharded": True} if sharded else {})}
        atomic_write_text(tmp / pm.REQUEST, json.dumps(request, indent=1, sort_keys=True))
        os.rename(tmp, final)
        fsync_dir(run.predictions)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PredictionRequest(name, final, step, False)


def _checked_name(name: str) -> str:
    try:
        return pm.check_name(name)
    except ValueError as exc:
        raise UserError.on(INPUTS["name"], str(exc)) from None


def _existing(run: RunDir, name: Optional[str]) -> Optional[dict]:
    if name is None:
        return None
    try:
        return pm.read_request(run.predictions / name)
    except FileNotFoundError:
        return None


def _request(run: RunDir, request: dict) -> PredictionRequest:
    """Re-open a prediction; a committed one whose chunks no longer verify is reopened
    for the workers (they redo exactly the chunks that fail their records)."""
    path = run.predictions / request["name"]
    manifest_path = path / pm.MANIFEST
    if not manifest_path.exists():
        return PredictionRequest(request["name"], path, request["step"], False)
    problems = pm.verify_chunks(path, pm.read_record(manifest_path))
    if problems:
        manifest_path.rename(path / f"{pm.MANIFEST}.failed-{time.time_ns()}")
        print(f"prediction {request['name']}: recomputing: " + "; ".join(problems),
              file=sys.stderr)
        return PredictionRequest(request["name"], path, request["step"], False)
    return PredictionRequest(request["name"], path, request["step"], True)


def _input_checksum(run: RunDir, request: dict, like: str) -> str:
    """The recorded input checksum, recomputed from the staged input when it was made
    with another algorithm (a prediction staged before checksums moved to xxh3)."""
    recorded = request["input"]["checksum"]
    if algorithm_of(recorded) == algorithm_of(like):
        return recorded
    staged = np.load(run.predictions / request["name"] / pm.INPUT, mmap_mode="r")
    return bytes_checksum(staged.reshape(-1).view(np.uint8), like=like)


def _reuse(run: RunDir, existing: dict, entry: dict, step: int) -> PredictionRequest:
    name = existing["name"]
    if entry["checksum"] != _input_checksum(run, existing, like=entry["checksum"]) or \
            entry["shape"] != existing["input"]["shape"]:
        raise UserError("prediction {value!r} already holds another input",
                        field=INPUTS["name"], value=name, where=run.predictions / name,
                        fix="pick another {field} or remove {where}")
    if step != existing["step"]:
        raise _other_step(name, existing["step"], step)
    return _request(run, existing)


def _other_step(name: str, made_from: int, step: int) -> UserError:
    return UserError("prediction {name!r} was made from step-{made_from}", field=INPUTS["step"],
                     value=step, name=name, made_from=made_from,
                     fix="use another {other} for another step", other=INPUTS["name"])
