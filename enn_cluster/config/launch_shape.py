"""The launch shape: how many processes, where. One value from the flags (or the API's
`cluster=` dict) to the Slurm job and the local launcher, so the node range, procs per
node and GPUs per node are decided once and every later step reads them from here.

Pure: no torch, nothing of ours but errors (and config's own checks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from enn_cluster.config.checks import MAX_PROCS_PER_NODE, node_range
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError


@dataclass(frozen=True)
class LaunchShape:
    """nodes (MIN, up to `max_nodes`: Slurm may grant any count in the range) x procs per
    node (one per GPU on GPU nodes). `gpus_per_node` is what was asked: a local run on a
    machine without GPUs runs on the CPU. `max_nodes` 0 means just `nodes`."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int = 0
    max_nodes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_nodes", max(self.max_nodes, self.nodes))

    @property
    def world(self) -> int:
        """Processes at the fewest nodes."""
        return self.nodes * self.procs_per_node

    @property
    def node_range(self) -> tuple[int, int]:
        return self.nodes, self.max_nodes

    @property
    def node_counts(self) -> tuple[int, ...]:
        return tuple(range(self.nodes, self.max_nodes + 1))

    @property
    def job_nodes(self) -> Union[int, str]:
        """The node count as Slurm's --nodes takes it: N, or "MIN-MAX" for a range."""
        return self.nodes if self.nodes == self.max_nodes else f"{self.nodes}-{self.max_nodes}"

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node or self.procs_per_node


@dataclass(frozen=True)
class ShapeRequest:
    """The shape as asked: None where the caller did not say (the config's, the site's).
    `nodes`: N or "MIN-MAX", as typed."""

    nodes: Union[None, int, str] = None
    gpus_per_node: Optional[int] = None
    procs_per_node: Optional[int] = None
    max_restarts: Optional[int] = None

    @classmethod
    def from_flags(cls, args) -> "ShapeRequest":
        return cls(args.nodes, args.gpus_per_node, args.procs_per_node,
                   getattr(args, "max_restarts", None))

    @classmethod
    def from_cluster(cls, cluster: Optional[dict]) -> "ShapeRequest":
        c = cluster or {}
        return cls(c.get("nodes"), c.get("gpus_per_node"), c.get("procs_per_node"))


def shape_from_flags(cfg: RunConfig, nodes, gpus_per_node: Optional[int],
                     procs_per_node: Optional[int]) -> LaunchShape:
    """The shape asked (`nodes`: N, "MIN-MAX" or None), the config's parallel.nodes and
    procs_per_node where nothing was; GPU runs use one process per GPU."""
    lo, hi = node_range(nodes) if nodes is not None else (cfg.parallel.nodes,) * 2
    gpus = gpus_per_node or 0
    if not 0 <= gpus <= MAX_PROCS_PER_NODE:
        raise UserError("{value} must be >= 0 and at most {most}", field=INPUTS["gpus_per_node"],
                        value=gpus, most=MAX_PROCS_PER_NODE)
    procs = procs_per_node if procs_per_node is not None else (gpus or cfg.parallel.procs_per_node)
    if not 1 <= procs <= MAX_PROCS_PER_NODE:
        raise UserError("{value} must be >= 1 and at most {most}", field=INPUTS["procs_per_node"],
                        value=procs, most=MAX_PROCS_PER_NODE)
    if gpus and procs != gpus:
        raise UserError("{value} differs from {gpus}", field=INPUTS["procs_per_node"],
                        value=procs, gpus=Said(INPUTS["gpus_per_node"], gpus),
                        fix="GPU runs use one process per GPU")
    return LaunchShape(lo, procs, gpus, hi)
