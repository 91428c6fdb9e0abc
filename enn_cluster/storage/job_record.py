"""One line of a run's jobs.jsonl: every launch of the run (our local launcher, a Slurm job,
an external launcher's rank 0) and every relaunch after a lost node, in one typed record.

Older versions wrote four shapes (local `procs_per_node`, Slurm `tasks_per_node`, an
external launcher's `world_size`, a relaunch's host list under `nodes`); `from_json`
reads them all, so a run made by any version keeps its history, and keys it does not know
are kept as they were written (a newer version's, read by this one). Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional, Union

RELAUNCH = "relaunch"  # the kind of a relaunch record; every other kind is a launch


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """A launch: `kind` is the launcher (local, slurm, torchrun, single) or "relaunch";
    `nodes` a count or "MIN-MAX" (a Slurm range), tasks per node and world size where
    known. A relaunch adds the hosts it went on with, the lost ones, its times and step."""

    kind: str
    time: Optional[float] = None
    task: Optional[str] = None
    name: Optional[str] = None  # a prediction's name
    job_id: Optional[str] = None
    job_name: Optional[str] = None
    pid: Optional[int] = None
    nodes: Union[None, int, str] = None
    tasks_per_node: Optional[int] = None
    world_size: Optional[int] = None
    image: Optional[str] = None
    signal_grace_s: Optional[int] = None
    source: Optional[str] = None  # "logs": known only from the workers' log folders
    relaunch: Optional[int] = None
    lost: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    ended: Optional[float] = None
    detected: Optional[float] = None
    launched: Optional[float] = None
    step: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "JobRecord":
        """A record as any version wrote it (`data`: one parsed line, a dict)."""
        data = {"kind": "", **data}  # a hand-written line may lack it: no launcher we know
        if "procs_per_node" in data and "tasks_per_node" not in data:  # a local launch's
            data["tasks_per_node"] = data.pop("procs_per_node")
        if data.get("kind") == RELAUNCH and isinstance(data.get("nodes"), list):
            data["hosts"] = data.pop("nodes")  # the hosts a relaunch went on with
        if data.get("job_id") is not None:
            data["job_id"] = str(data["job_id"])
        for name in ("lost", "hosts"):
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    def as_json(self) -> dict:
        """The line's object: the fields that are set, the unknown keys as read."""
        out = dict(self.extra)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None and value != ():
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def stamped(self, now: float) -> "JobRecord":
        return self if self.time is not None else replace(self, time=now)

    @property
    def is_slurm(self) -> bool:
        return self.kind == "slurm"
