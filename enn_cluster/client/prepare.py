"""From a user's request to running workers: make the run, stage data, launch.

The CLI and the Python API both call these functions, so both drive the same code.
Nothing here imports torch at module import time (the CLI must start fast).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from enn_cluster.client.launch_plan import (  # noqa: F401  (LaunchShape, shape_from_flags: API)
    LaunchPlan,
    LaunchShape,
    batch_plans,
    plan_shape,
    shape_from_flags,
)
from enn_cluster.config.lm_config import LM_TASK, is_hf_model
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.data_sources import check_data_sources
from enn_cluster.storage.text_sources import check_text_sources, is_text_data
from enn_cluster.storage.rundir import RunDir, create_run_dir, run_umask, update_config
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, release_lock
from enn_cluster.storage.staging import read_manifest, stage_run_data


def check_model_importable(name: str) -> None:
    """A `module:factory` model must import in the workers: import it now (the workers would
    run the same import) and check that the factory is a class or function, so that a typo
    is one line here rather than a traceback on every rank after the job started."""
    if is_hf_model(name):
        check_hf_model(name)
        return
    if ":" not in name:
        return
    import importlib
    import importlib.util
    import inspect

    module, attr = name.split(":", 1)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"model.name: module {module!r} is not importable; put it on "
                        "PYTHONPATH (every node must see it) or pip install it")
    try:
        factory = importlib.import_module(module)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except AttributeError:
        raise UserError(f"model.name: module {module!r} has no {attr!r}; name a class or "
                        "function that returns an nn.Module") from None
    except Exception as exc:  # the user's module failed to import: say so in one line
        raise UserError(f"model.name: importing {module!r} failed ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); fix the module") from None
    if not (inspect.isclass(factory) or inspect.isfunction(factory) or inspect.ismethod(factory)):
        raise UserError(f"model.name: {name} is a {type(factory).__name__}, not a model factory "
                        "(a class or Python function returning an nn.Module)")


def check_hf_model(name: str) -> None:
    """An `hf:` model needs the llm extra and a weights directory with safetensors."""
    import importlib.util

    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"model.name: {name} needs {' and '.join(missing)}; "
                        "pip install 'enn_cluster[llm]' (and in the image)")
    from enn_cluster.config.hf_name import weights_dir

    path = weights_dir(name)
    if not any(path.glob("*.safetensors")):
        raise UserError(f"model.name: {path} has no *.safetensors weights; save the model with "
                        "save_pretrained(..., safe_serialization=True) there")


def prepare_run(cfg: RunConfig, shape: LaunchShape, arrays: Optional[dict] = None,
                populate_extra=None) -> RunDir:
    """Validate, then create the run directory with staged data (all or nothing)."""
    return prepare_run_and_config(plan_shape(cfg, shape), arrays, populate_extra)[0]


def prepare_run_and_config(plan: LaunchPlan, arrays: Optional[dict] = None,
                           populate_extra=None) -> tuple[RunDir, RunConfig]:
    """`prepare_run` for a plan: the run directory, and the config frozen into its
    config.yaml (the plan's), which the launch that follows is handed rather than reading
    the file back."""
    cfg = replace(plan.cfg, runs_root=str(Path(plan.cfg.runs_root).expanduser().resolve()))
    check_model_importable(cfg.model.name)
    if cfg.model.task == LM_TASK and not arrays and is_text_data(cfg.data):
        check_text_sources(cfg.data, cfg.model)
    elif not arrays:
        check_data_sources(cfg.data)

    def populate(run: RunDir) -> None:
        manifest = stage_run_data(cfg.data, cfg.model, run.data_dir, arrays, progress=sys.stderr)
        batch_plans(cfg, plan.shape, plan.meshes,
                    manifest["train_rows"][1] - manifest["train_rows"][0])
        if populate_extra is not None:
            populate_extra(run)

    return create_run_dir(cfg, populate), cfg


def resumed_config(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A run's config (as loaded) with `resume --set` overrides applied."""
    from enn_cluster.config.loading import apply_overrides, config_from_dict, config_to_dict

    return config_from_dict(apply_overrides(config_to_dict(cfg), overrides)) if overrides \
        else cfg


def prepare_resume(run: RunDir, cfg: RunConfig, plan: LaunchPlan) -> RunConfig:
    """Re-freeze the run's config (`cfg`, as loaded by the caller) as the plan has it (a new
    shape, any overrides), once its batch is checked against the staged rows."""
    manifest = read_manifest(run.data_dir)
    batch_plans(plan.cfg, plan.shape, plan.meshes,
                manifest["train_rows"][1] - manifest["train_rows"][0])
    if plan.cfg != cfg:
        update_config(run, plan.cfg)
    return plan.cfg


def run_local(run: RunDir, plan: LaunchPlan, name: Optional[str] = None,
              step: Optional[int] = None) -> int:
    """Hold the run lock while local workers run; record the launch in jobs.jsonl. The
    plan's config is the run's as the command holds it (for the MLflow run the workers
    log into)."""
    from enn_cluster.client.launch_local import launch_local
    from enn_cluster.storage.tracking import ensure_run

    cfg, shape, task = plan.cfg, plan.shape, plan.task
    owner = acquire_lock(run, lock_owner())
    try:
        ensure_run(run, cfg)
        run.record_job(kind="local", task=task, pid=os.getpid(), nodes=shape.nodes,
                       procs_per_node=shape.procs_per_node, name=name)
        with run_umask():  # the workers inherit it: checkpoints, logs, metrics
            return launch_local(str(run.path), task, nodes=shape.nodes,
                                procs_per_node=shape.procs_per_node,
                                gpus_per_node=shape.gpus_per_node,
                                max_restarts=plan.restarts, name=name, step=step,
                                launch_id=f"local-{len(run.jobs())}",
                                stop_grace_s=cfg.parallel.stop_grace_s)
    finally:
        release_lock(run, owner)
