"""The launch plan, built once per command: a config, the shape asked for (the CLI's flags,
the API's `cluster=` dict), the site and this machine become the shape, the mesh at every
node count the job may get, the run's batch at each, and the Slurm job. The CLI and the API
both call `plan_launch`, so they cannot drift.

Checks that need the world size run here, once the flags have given it: the config's own
parallel.nodes/procs_per_node are defaults for the shape, not a world to check against.
Pure: this machine comes in as a `Machine` value (`Machine.here()` reads it); no torch.
"""
from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Optional

from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.submit_slurm import SlurmRequest, build_spec
from enn_cluster.config.checks import node_range
from enn_cluster.config.launch_shape import LaunchShape, ShapeRequest, shape_from_flags
from enn_cluster.config.run_config import MeshPlan, RunConfig, plan_mesh
from enn_cluster.config.schedule import (
    BatchPlan,
    plan_batch,
    requested_global_batch,
    total_steps,
)
from enn_cluster.config.inputs import INPUTS, ON_SLURM
from enn_cluster.errors import Said, UserError

LOCAL_PROCS_PER_CPU = 4  # the most local processes per CPU we start without being told to
# the local run that works anywhere: --gpus-per-node 0 --procs-per-node 2
LOCAL_CPU_FORM = (Said(INPUTS["gpus_per_node"], 0), Said(INPUTS["procs_per_node"], 2))


@dataclass(frozen=True)
class Machine:
    """What a local run can use here: CPUs, GPU devices, and whether sbatch is at hand."""

    cpus: int
    gpus: int
    sbatch: bool

    @classmethod
    def here(cls) -> "Machine":
        gpus = len(glob.glob("/dev/nvidia[0-9]*")) or int(os.path.exists("/dev/kfd"))
        return cls(os.cpu_count() or 1, gpus, shutil.which("sbatch") is not None)

    @property
    def process_cap(self) -> int:
        return max(8, LOCAL_PROCS_PER_CPU * self.cpus)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs, decided: `cfg` carries the shape (train) and the run's
    global batch; `meshes` and `batches` hold each node count the job may get (train only);
    `spec` is the Slurm job for `spec_run_dir` (None: local, or no run directory yet)."""

    cfg: RunConfig
    task: str
    shape: LaunchShape
    restarts: int
    meshes: Mapping[int, MeshPlan] = field(default_factory=dict)
    batches: Mapping[int, BatchPlan] = field(default_factory=dict)
    slurm: Optional[SlurmRequest] = None
    spec: Optional[JobSpec] = None
    warnings: tuple[str, ...] = ()

    def for_job(self, run_dir: Path, name: Optional[str] = None) -> "LaunchPlan":
        """This plan with the Slurm job of `run_dir` (and prediction `name`) built: a bad
        flag is refused here, before the caller writes anything."""
        if self.slurm is None:
            return self
        if self.spec is not None and self.spec.run_dir == str(run_dir) and \
                self.spec.predict_name == name:
            return self
        from enn_cluster.models import kind_of

        return replace(self, spec=build_spec(self.slurm, Path(run_dir), self.task, self.shape,
                                             self.restarts, name=name, cfg=self.cfg,
                                             read_dirs=kind_of(self.cfg).read_dirs(self.cfg)))


def with_shape(cfg: RunConfig, shape: LaunchShape) -> RunConfig:
    return replace(cfg, parallel=replace(cfg.parallel, nodes=shape.nodes,
                                         procs_per_node=shape.procs_per_node))


def mesh_plans(cfg: RunConfig, shape: LaunchShape) -> dict[int, MeshPlan]:
    """The mesh at every node count the job may get, fewest first (a mesh Slurm could
    grant but we cannot build is refused here, not at start)."""
    return {nodes: plan_mesh(cfg.parallel, nodes * shape.procs_per_node, shape.procs_per_node)
            for nodes in shape.node_counts}


def batch_plans(cfg: RunConfig, shape: LaunchShape, meshes: Mapping[int, MeshPlan],
                n_rows: Optional[int] = None) -> dict[int, BatchPlan]:
    """The split of the run's global batch over each mesh, and the step budget once the
    rows are known: what would make workers fail at start, found before launch."""
    batches = {}
    for nodes, plan in meshes.items():
        batches[nodes] = plan_batch(cfg.training, plan.world, shape.procs_per_node)
        if n_rows is not None:
            total_steps(cfg.training, n_rows, batches[nodes].global_batch)
    return batches


def freeze_global_batch(cfg: RunConfig, meshes: Mapping[int, MeshPlan]) -> RunConfig:
    """The first launch fixes the run's global batch (per-device x accumulation x ranks),
    at the most nodes it may get: fewer nodes then accumulate more, never a bigger micro-batch."""
    if cfg.training.global_batch_size:
        return cfg
    world = meshes[max(meshes)].world
    gb = requested_global_batch(cfg.training, world)
    return replace(cfg, training=replace(cfg.training, global_batch_size=gb))


def plan_shape(cfg: RunConfig, shape: LaunchShape, task: str = "train",
               restarts: int = 0, slurm: Optional[SlurmRequest] = None) -> LaunchPlan:
    """The plan for a shape already decided. A training run's config takes the shape and
    its global batch, then the mesh and batch are checked at every node count; a
    prediction keeps the run's config as it is."""
    if task != "train":
        return LaunchPlan(cfg, task, shape, restarts, slurm=slurm)
    cfg = with_shape(cfg, shape)
    meshes = mesh_plans(cfg, shape)  # the mesh before the batch
    cfg = freeze_global_batch(cfg, meshes)
    return LaunchPlan(cfg, task, shape, restarts, meshes, batch_plans(cfg, shape, meshes),
                      slurm=slurm)


def max_restarts(requested: Optional[int], cfg: RunConfig) -> int:
    value = cfg.parallel.max_restarts if requested is None else requested
    if value < 0:
        raise UserError(f"--max-restarts: {value} must be >= 0")
    return value


def plan_launch(cfg: RunConfig, asked: ShapeRequest, task: str = "train", *,
                slurm: Optional[SlurmRequest] = None, machine: Optional[Machine] = None,
                run_dir: Optional[Path] = None, name: Optional[str] = None) -> LaunchPlan:
    """The one plan of a launch. `slurm`: the Slurm request (None: not on Slurm; its site
    config gives GPUs per node when none are asked). `machine`: this machine, for a run
    whose processes all start here (None: an external launcher, or Slurm). `run_dir`:
    build (and so check) the Slurm job for it now."""
    gpus = asked.gpus_per_node
    if gpus is None and slurm is not None:
        gpus = slurm.site_options().gpus_per_node
    warnings: tuple[str, ...] = ()
    if machine is not None:
        warnings = check_gpus_here(cfg, asked, gpus, machine)
    shape = shape_from_flags(cfg, asked.nodes, gpus, asked.procs_per_node)
    if machine is not None:
        check_local_capacity(shape, asked.procs_per_node is not None, machine)
    plan = plan_shape(cfg, shape, task, max_restarts(asked.max_restarts, cfg), slurm)
    plan = replace(plan, warnings=warnings)
    return plan.for_job(run_dir, name) if run_dir is not None else plan


def check_gpus_here(cfg: RunConfig, asked: ShapeRequest, gpus: Optional[int],
                    machine: Machine) -> tuple[str, ...]:
    """GPUs asked of a local run on a machine that has none: the ranks would run on the
    CPU. A shape that fits this machine runs, with a warning; one that does not (or one
    that also names another --procs-per-node) is refused with the forms that work."""
    if not gpus or machine.gpus:
        return ()
    nodes = node_range(asked.nodes)[0] if asked.nodes is not None else cfg.parallel.nodes
    if (asked.procs_per_node not in (None, gpus)) or nodes * gpus > machine.process_cap:
        here = "this machine has no GPU" + ("" if machine.sbatch else
                                            " and no Slurm (no sbatch on PATH)")
        raise UserError(
            "{value} asked, but {here}; a local run would start {nodes} x {value} = {world} "
            "CPU processes on {cpus} CPUs. Run on this machine's CPU with {cpu} {cpu_procs}, "
            "or on a cluster with {slurm}", field=INPUTS["gpus_per_node"], value=gpus, here=here,
            nodes=nodes, world=nodes * gpus, cpus=machine.cpus, cpu=LOCAL_CPU_FORM[0],
            cpu_procs=LOCAL_CPU_FORM[1], slurm=ON_SLURM)
    return (f"--gpus-per-node {gpus}: this machine has no GPU; the {nodes * gpus} local "
            f"ranks run on the CPU (pass --gpus-per-node 0 to say so, or --cluster slurm)",)


def check_local_capacity(shape: LaunchShape, procs_given: bool, machine: Machine) -> None:
    """The local launcher starts every process on this machine: a shape meant for GPU nodes
    would start dozens of trainers on a login node. Refused beyond a few processes per CPU
    unless --procs-per-node says the number on purpose."""
    cap = machine.process_cap
    if not procs_given and shape.world > cap:
        raise UserError("a local run would start {nodes} x {procs} = {world} processes on "
                        "this machine ({cpus} CPUs; at most {cap} unless asked for)",
                        field=INPUTS["procs_per_node"], nodes=shape.nodes,
                        procs=shape.procs_per_node, world=shape.world, cpus=machine.cpus,
                        cap=cap, fix="pass {field} to mean it, or {slurm} to run on the cluster",
                        slurm=ON_SLURM)
