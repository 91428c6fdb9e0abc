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

from enn_cluster.client.launch_plan import LaunchPlan, batch_plans, plan_shape
from enn_cluster.config.launch_shape import (  # noqa: F401  (shape_from_flags: API)
    LaunchShape,
    shape_from_flags,
)
from enn_cluster.cluster.slurm import lock_liveness
from enn_cluster.config.lm_config import is_hf_model
from enn_cluster.config.run_config import RunConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.data_sources import check_data_sources
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.lustre import stripe_new_directory
from enn_cluster.storage.text_sources import check_text_sources
from enn_cluster.storage.rundir import RunDir, create_run_dir, run_umask, update_config
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, release_lock
from enn_cluster.storage.staging import read_manifest, stage_run_data


def check_model(cfg: RunConfig) -> None:
    """What the model's kind needs on this machine, checked before anything is written (a
    `module:factory` imports, as the workers would import it; an `hf:` model has the llm
    extra and safetensors): one line here rather than a traceback on every rank."""
    import importlib.util

    from enn_cluster.models import kind_of

    kind_of(cfg).check(cfg)
    if cfg.training.float8 and importlib.util.find_spec("torchao") is None:
        raise UserError("training.float8: needs torchao; pip install 'enn_cluster[float8]' "
                        "(and in the image), or set training.float8: false")


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
    check_model(cfg)
    from enn_cluster.models import kind_of

    text = not arrays and kind_of(cfg).stages_text(cfg)
    if text:
        check_text_sources(cfg.data, cfg.model)
    elif not arrays:
        check_data_sources(cfg.data)

    def populate(run: RunDir) -> None:
        striped = stripe_new_directory(run.checkpoints, cfg.checkpoint.lustre_stripe_count)
        if striped:
            print(striped, file=sys.stderr)
        manifest = stage_run_data(cfg.data, cfg.model, run.data_dir, arrays, progress=sys.stderr,
                                  text=text)
        kind_of(cfg).check_staged(cfg, run.data_dir, manifest)
        batch_plans(cfg, plan.shape, plan.meshes,
                    manifest["train_rows"][1] - manifest["train_rows"][0])
        if populate_extra is not None:
            populate_extra(run)

    return create_run_dir(cfg, populate), cfg


# What shapes the model a run's checkpoints hold. Dropout and LoRA's alpha may change on
# resume; an hf: model's folder may move (the workers check the base weights).
MODEL_SHAPE_FIELDS = ("model.task", "model.hidden_sizes", "model.d_model", "model.n_layers",
                      "model.n_heads", "model.kwargs", "lora.r", "lora.target_modules")


def resumed_config(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A run's config (as loaded) with `resume --set` overrides applied; one that changes the
    model the checkpoints hold is refused before the config is re-frozen (its workers would
    find no step that loads)."""
    from enn_cluster.config.loading import apply_overrides, config_from_dict, config_to_dict

    if not overrides:
        return cfg
    new = config_from_dict(apply_overrides(config_to_dict(cfg), overrides))
    old_name, new_name = cfg.model.name, new.model.name
    moved = old_name != new_name and not (is_hf_model(old_name) and is_hf_model(new_name))
    for key in ("model.name",) * moved + MODEL_SHAPE_FIELDS:
        section, name = key.split(".")
        was, now = getattr(getattr(cfg, section), name), getattr(getattr(new, section), name)
        if was != now:
            raise UserError(f"{key}: the run's checkpoints hold a model of {key} {was!r}, not "
                            f"{str(now)[:80]!r}; a resume keeps the run's model: drop that "
                            "--set, or start a new run (enn-submit train) for the new model")
    return new


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
              step: Optional[int] = None, fork: bool = False) -> int:
    """Hold the run lock while local workers run; record the launch in jobs.jsonl. The
    plan's config is the run's as the command holds it (for the MLflow run the workers
    log into). `fork`: this is a process of our own, and the workers are forked from it
    once it has imported what the model's workers import (launch_local)."""
    from enn_cluster.client.launch_local import launch_local
    from enn_cluster.models import kind_of
    from enn_cluster.config.launch_env import handed_to_workers
    from enn_cluster.storage.tracking import ensure_run

    cfg, shape, task = plan.cfg, plan.shape, plan.task
    owner = acquire_lock(run, lock_owner(), slurm_job_alive=lock_liveness())
    try:
        tracking = ensure_run(run, cfg)
        run.record_job(JobRecord(kind="local", task=task, pid=os.getpid(), nodes=shape.nodes,
                                 tasks_per_node=shape.procs_per_node, name=name))
        # the workers inherit both: the umask for checkpoints, logs, metrics
        with run_umask(), handed_to_workers(tracking):
            return launch_local(str(run.path), task, nodes=shape.nodes,
                                procs_per_node=shape.procs_per_node,
                                gpus_per_node=shape.gpus_per_node,
                                max_restarts=plan.restarts, name=name, step=step,
                                launch_id=f"local-{len(run.jobs())}",
                                stop_grace_s=cfg.parallel.stop_grace_s,
                                preload=kind_of(cfg).worker_imports(cfg) if fork else None)
    finally:
        release_lock(run, owner)
