"""From a user's request to running workers: make the run, stage data, launch.

The CLI and the Python API both call these functions, so both drive the same code.
Nothing here imports torch at module import time (the CLI must start fast).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from enn_cluster.config.checks import MAX_PROCS_PER_NODE, node_range
from enn_cluster.config.lm_config import LM_TASK, is_hf_model
from enn_cluster.config.run_config import MeshPlan, RunConfig, plan_mesh
from enn_cluster.config.schedule import plan_batch, requested_global_batch, total_steps
from enn_cluster.errors import UserError
from enn_cluster.storage.data_sources import check_data_sources
from enn_cluster.storage.text_sources import check_text_sources, is_text_data
from enn_cluster.storage.rundir import RunDir, create_run_dir, run_umask, update_config
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, release_lock
from enn_cluster.storage.staging import read_manifest, stage_run_data


@dataclass(frozen=True)
class LaunchShape:
    """How many processes, where: nodes x procs per node (one per GPU on GPU nodes)."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int = 0
    max_nodes: int = 0  # --nodes MIN-MAX on Slurm: any count up to this may be granted

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def node_counts(self) -> tuple:
        return tuple(range(self.nodes, max(self.max_nodes, self.nodes) + 1))


def shape_from_flags(cfg: RunConfig, nodes, gpus_per_node: Optional[int],
                     procs_per_node: Optional[int]) -> LaunchShape:
    nodes, max_nodes = node_range(nodes) if nodes is not None else (cfg.parallel.nodes,) * 2
    gpus = gpus_per_node or 0
    if not 0 <= gpus <= MAX_PROCS_PER_NODE:
        raise UserError(f"--gpus-per-node: {gpus} must be >= 0 and at most {MAX_PROCS_PER_NODE}")
    procs = procs_per_node if procs_per_node is not None else (gpus or cfg.parallel.procs_per_node)
    if not 1 <= procs <= MAX_PROCS_PER_NODE:
        raise UserError(f"--procs-per-node: {procs} must be >= 1 and at most {MAX_PROCS_PER_NODE}")
    if gpus and procs != gpus:
        raise UserError(f"--procs-per-node: {procs} differs from --gpus-per-node {gpus}; "
                        "GPU runs use one process per GPU")
    return LaunchShape(nodes, procs, gpus, max_nodes)


def mesh_plans(cfg: RunConfig, shape: LaunchShape) -> dict[int, MeshPlan]:
    """The mesh at every node count the job may get, fewest first: planned once per launch
    and passed to the checks below (a mesh Slurm could grant but we cannot build is refused
    here, not at start)."""
    return {nodes: plan_mesh(cfg.parallel, nodes * shape.procs_per_node, shape.procs_per_node)
            for nodes in shape.node_counts}


def check_shape(cfg: RunConfig, shape: LaunchShape, meshes: dict[int, MeshPlan],
                n_rows: Optional[int] = None) -> None:
    """Everything that would make workers fail at start, checked before launch: the split of
    the run's global batch over each mesh, and the step budget once the rows are known."""
    for plan in meshes.values():
        batch = plan_batch(cfg.training, plan.world, shape.procs_per_node)
        if n_rows is not None:
            total_steps(cfg.training, n_rows, batch.global_batch)


def freeze_global_batch(cfg: RunConfig, meshes: dict[int, MeshPlan]) -> RunConfig:
    """The first launch fixes the run's global batch (per-device x accumulation x ranks),
    at the most nodes it may get: fewer nodes then accumulate more, never a bigger micro-batch."""
    if cfg.training.global_batch_size:
        return cfg
    world = meshes[max(meshes)].world
    gb = requested_global_batch(cfg.training, world)
    return replace(cfg, training=replace(cfg.training, global_batch_size=gb))


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


def with_shape(cfg: RunConfig, shape: LaunchShape) -> RunConfig:
    return replace(cfg, parallel=replace(cfg.parallel, nodes=shape.nodes,
                                         procs_per_node=shape.procs_per_node))


def prepare_run(cfg: RunConfig, shape: LaunchShape, arrays: Optional[dict] = None,
                populate_extra=None) -> RunDir:
    """Validate, then create the run directory with staged data (all or nothing)."""
    return prepare_run_and_config(cfg, shape, arrays, populate_extra)[0]


def prepare_run_and_config(cfg: RunConfig, shape: LaunchShape, arrays: Optional[dict] = None,
                           populate_extra=None) -> tuple[RunDir, RunConfig]:
    """`prepare_run`, and the config frozen into its config.yaml: the launch that follows
    is handed this one rather than reading the file back."""
    cfg = with_shape(replace(cfg, runs_root=str(Path(cfg.runs_root).expanduser().resolve())),
                     shape)
    meshes = mesh_plans(cfg, shape)  # the mesh before the batch
    cfg = freeze_global_batch(cfg, meshes)
    check_shape(cfg, shape, meshes)
    check_model_importable(cfg.model.name)
    if cfg.model.task == LM_TASK and not arrays and is_text_data(cfg.data):
        check_text_sources(cfg.data, cfg.model)
    elif not arrays:
        check_data_sources(cfg.data)

    def populate(run: RunDir) -> None:
        manifest = stage_run_data(cfg.data, cfg.model, run.data_dir, arrays, progress=sys.stderr)
        check_shape(cfg, shape, meshes, manifest["train_rows"][1] - manifest["train_rows"][0])
        if populate_extra is not None:
            populate_extra(run)

    return create_run_dir(cfg, populate), cfg


def prepare_resume(run: RunDir, cfg: RunConfig, shape: LaunchShape,
                   overrides: list[str]) -> RunConfig:
    """Re-freeze the run's config (`cfg`, as loaded by the caller) with a new shape and any
    overrides; data stays as staged."""
    from enn_cluster.config.loading import apply_overrides, config_from_dict, config_to_dict

    data = apply_overrides(config_to_dict(cfg), overrides) if overrides else config_to_dict(cfg)
    new = with_shape(config_from_dict(data), shape)
    manifest = read_manifest(run.data_dir)
    check_shape(new, shape, mesh_plans(new, shape),
                manifest["train_rows"][1] - manifest["train_rows"][0])
    if new != cfg:
        update_config(run, new)
    return new


def run_local(run: RunDir, task: str, shape: LaunchShape, max_restarts: int,
              name: Optional[str] = None, step: Optional[int] = None, *, cfg: RunConfig) -> int:
    """Hold the run lock while local workers run; record the launch in jobs.jsonl. `cfg`:
    the run's config as the command holds it (for the MLflow run the workers log into)."""
    from enn_cluster.client.launch_local import launch_local
    from enn_cluster.storage.tracking import ensure_run

    owner = acquire_lock(run, lock_owner())
    try:
        ensure_run(run, cfg)
        run.record_job(kind="local", task=task, pid=os.getpid(), nodes=shape.nodes,
                       procs_per_node=shape.procs_per_node, name=name)
        with run_umask():  # the workers inherit it: checkpoints, logs, metrics
            return launch_local(str(run.path), task, nodes=shape.nodes,
                                procs_per_node=shape.procs_per_node,
                                max_restarts=max_restarts, name=name, step=step,
                                launch_id=f"local-{len(run.jobs())}",
                                stop_grace_s=cfg.parallel.stop_grace_s)
    finally:
        release_lock(run, owner)
