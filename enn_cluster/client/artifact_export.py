"""`enn-submit export`: a DCP checkpoint consolidated into an inference artifact.

Why: a DCP checkpoint is sharded, holds the optimizer, and needs this package to read;
serving wants one file. The artifact directory holds `model.pt` (the full fp32 state
dict, loadable with `torch.load(..., weights_only=True)`), with `--format export` also
`model.pt2` (a `torch.export` program with a dynamic batch dimension, weights inside),
and `export.json` (run, step, input shape, the target scaler to apply to outputs, each
file's size and checksum). It is written under a temporary name and renamed, so a
failed export leaves nothing. safetensors is not used for these: a tensor-only
`torch.save` read with `weights_only=True` runs no pickled code either, and `model.pt2` is
the framework-neutral form. A causal LM's `--format hf` is the Hugging Face directory
(safetensors shards, streamed in the base's dtype by client/hf_stream.py, `--dtype` and
`--max-shard-mb` to choose); `--format peft` its adapters.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import traceback
import warnings
from pathlib import Path
from typing import Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError
from enn_cluster.storage import commits as store
from enn_cluster.storage.output_target import missing_parents, remove_empty
from enn_cluster.storage.rundir import RunDir, atomic_write_text, fsync_dir

LM_FORMATS = ("hf", "peft")  # Hugging Face forms (client/lm_artifacts): a kind's export_formats
FORMATS = ("torch", "export", *LM_FORMATS)
FORMAT = INPUTS["format"]
STATE_FILE, PROGRAM_FILE, RECORD_FILE = "model.pt", "model.pt2", "export.json"


def offending_line(exc: BaseException, torch_dir: str) -> str:
    """One line from torch.export's error: its first line and the user code that raised it
    (the last frame outside torch), e.g. 'Could not guard on data-dependent expression ...
    at models.py:12 `if x.mean() > 0:`'."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.endswith(__file__)]
    if frames:
        f = frames[-1]
        text += f" at {f.filename}:{f.lineno}" + (f" `{f.line.strip()}`" if f.line else "")
    return text


def export_program(model, input_shape: tuple, model_name: str):
    """The model as a torch.export program with a dynamic batch; UserError naming the
    offending operation when the forward is not export-safe."""
    import torch

    example = (torch.zeros((2,) + tuple(input_shape)),)
    logging.disable(logging.WARNING)  # a failed trace prints its whole graph; we say one line
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return torch.export.export(model, example,
                                       dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    except Exception as exc:  # torch raises many types here; all mean "not exportable"
        raise UserError("{name} is not export-safe: {why}", field="model.name",
                        name=model_name, why=offending_line(exc, os.path.dirname(torch.__file__)),
                        fix="make the forward traceable (no data-dependent Python branches or "
                            "host round trips) or export the weights alone with {torch}",
                        torch=Said(FORMAT, "torch"))
    finally:
        logging.disable(logging.NOTSET)


def export_problem(model, input_shape: tuple, model_name: str) -> Optional[str]:
    """None when `model` exports, else the one-line reason (doctor's export layer)."""
    try:
        export_program(model, input_shape, model_name)
    except UserError as exc:
        return str(exc)
    return None


def export_run(run_dir, out, *, step: Optional[int] = None, fmt: str = "torch",
               said: Optional[list] = None, dtype: Optional[str] = None,
               max_shard_mb: Optional[float] = None) -> Path:
    """Write the artifact directory `out`; returns its path. Nothing is left on error. The
    line naming newer steps passed over (step_choice.fallback_line) goes into `said` for
    the caller to print last, else out as a RuntimeWarning once the export is written.
    `dtype` and `max_shard_mb` shape `--format hf` (the base's dtype, 5,000 MB shards)."""
    from enn_cluster.client.prepare import check_model
    from enn_cluster.storage.staging import read_manifest
    from enn_cluster.storage.step_choice import choose_step

    run = RunDir.existing(run_dir)
    if fmt not in FORMATS:
        raise UserError("{value!r} is not a format", field=FORMAT, value=fmt,
                        fix="use one of {formats}", formats=", ".join(FORMATS))
    shard_bytes = check_hf_options(fmt, dtype, max_shard_mb)
    out = Path(out).resolve()
    if out.exists():
        raise UserError("{value} exists", field=INPUTS["out"], value=out,
                        fix="give a new directory")
    step, fallback = choose_step(run.checkpoints, step)
    cfg, manifest = run.load_config(), read_manifest(run.data_dir)
    check_model(cfg)  # the weights folder (an LM's) as prepare checked it
    written = _export(run, cfg, manifest, step, out, fmt, (dtype, shard_bytes))
    if fallback and said is not None:
        said.append(fallback)
    elif fallback:
        warnings.warn(fallback, RuntimeWarning, stacklevel=2)
    return written


def check_hf_options(fmt: str, dtype: Optional[str], max_shard_mb: Optional[float]) -> Optional[int]:
    """--dtype and --max-shard-mb, which only --format hf takes; the shard size in bytes."""
    from enn_cluster.client.hf_stream import DTYPES

    for name, given in (("dtype", dtype), ("max_shard_mb", max_shard_mb)):
        if given is not None and fmt != "hf":
            raise UserError("applies to {hf} only (this export is {this})", field=INPUTS[name],
                            hf=Said(FORMAT, "hf"), this=Said(FORMAT, fmt), fix="leave it out")
    if dtype is not None and dtype not in DTYPES:
        raise UserError("{value!r} is not a dtype to write", field=INPUTS["dtype"], value=dtype,
                        fix="use one of {dtypes} (default: the base weights' own)",
                        dtypes=", ".join(DTYPES))
    if max_shard_mb is not None and not max_shard_mb > 0:
        raise UserError("{value} is not a size", field=INPUTS["max_shard_mb"], value=max_shard_mb,
                        fix="give megabytes > 0")
    return None if max_shard_mb is None else max(1, int(max_shard_mb * 1e6))


def _export(run: RunDir, cfg, manifest: dict, step: int, out: Path, fmt: str,
            hf_options: tuple = (None, None)) -> Path:
    import torch

    from enn_cluster.client.run_handle import Run

    if fmt in LM_FORMATS:
        return _export_lm(run, cfg, step, out, fmt, manifest, hf_options)
    with warnings.catch_warnings():  # DCP's note that it loads in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model = Run(run.path).load_model(step, raw=True)  # export.json holds the scaler
    input_shape = tuple(manifest["entries"]["train_x"]["shape"][1:])
    program = export_program(model, input_shape, cfg.model.name) if fmt == "export" else None

    def fill(tmp: Path) -> None:
        state = {k: v.detach().to(torch.float32).contiguous().clone()
                 for k, v in model.state_dict().items()}
        torch.save(state, tmp / STATE_FILE)
        if program is not None:
            torch.export.save(program, str(tmp / PROGRAM_FILE))

    return _write_artifact(out, fill, run, step, fmt, input_shape, manifest)


def _export_lm(run: RunDir, cfg, step: int, out: Path, fmt: str, manifest: dict,
               hf_options: tuple) -> Path:
    """A causal LM as a Hugging Face directory (or peft adapter)."""
    from enn_cluster.client.lm_artifacts import write_hf

    from enn_cluster.models import kind_of

    if "hf" not in kind_of(cfg).export_formats:
        raise UserError("{value} is for Hugging Face causal LMs (model.name: hf:DIR)",
                        field=FORMAT, value=fmt, name=cfg.model.name, torch=Said(FORMAT, "torch"),
                        fix="{name} exports with {torch} or export")
    return _write_artifact(out, lambda tmp: write_hf(cfg, store.step_dir(run.checkpoints, step),
                                                     tmp, fmt, manifest.get("text"),
                                                     *hf_options),
                           run, step, fmt, tuple(manifest["entries"]["train_x"]["shape"][1:]),
                           manifest)


def _write_artifact(out: Path, fill, run: RunDir, step: int, fmt: str, input_shape: tuple,
                    manifest: dict) -> Path:
    """`fill(tmp)` writes the artifact's files into a temporary directory beside `out`, which
    gets export.json and is renamed into place: a failed export leaves nothing."""
    made = missing_parents(out)  # folders this export makes, gone again if it fails
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        fill(tmp)
        _write_record(tmp, run, step, fmt, input_shape, manifest)
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        raise
    return out


def _write_record(tmp: Path, run: RunDir, step: int, fmt: str, input_shape: tuple,
                  manifest: dict) -> None:
    import torch

    names = sorted(p.name for p in tmp.iterdir())
    for name in names:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    files = store.checksum_files(tmp, names)
    record = {"run": str(run.path), "step": step, "format": fmt, "files": files,
              "input_shape": list(input_shape), "torch": torch.__version__,
              "target_scaler": manifest.get("target_scaler"),
              "note": "outputs are in normalised units when target_scaler is set: "
                      "y = output * std + mean"}
    atomic_write_text(tmp / RECORD_FILE, json.dumps(record, indent=1, sort_keys=True))
