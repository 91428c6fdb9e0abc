"""DCP checkpoints: save into a fresh step directory, commit, choose, load (resharding).

Save: every rank writes its shards (DCP, one file per rank), its RNG state, and rank 0
the trainer state. Commit: each rank checksums the files it wrote, rank 0 gathers them
on the control lane and writes `commit.json` last. Resume: rank 0 lists committed steps,
all ranks verify checksums of the newest in parallel, and the first that verifies
everywhere is broadcast. Loading at another world size reshards through DTensor metadata.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from . import checkpoint_store as store
from .lanes import Lanes
from .rundir import atomic_write_text

log = logging.getLogger("enn_cluster.checkpoint")
TRAINER_STATE = "trainer.json"


# -- loading without unpickling arbitrary objects ------------------------------------------
# DCP's FileSystemReader reads `.metadata` with plain pickle.load, and its DefaultLoadPlanner
# reads non-tensor entries (optimizer param_groups) with torch.load(weights_only=False):
# whoever can write a checkpoint directory could run code in every process that loads it.
# Tensor shards DCP already reads with weights_only=True. These two close the other paths.

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("torch.serialization", "_get_layout"), ("torch", "Size"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                     ("collections", "OrderedDict"), ("builtins", "set"),
                     ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    """Only what a DCP `.metadata` holds: its dataclasses, dtypes, layouts, Size, paths."""

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name) if module.split(".")[0] in (
            "torch", "pathlib", "collections", "builtins") else None
        if module == _METADATA_MODULE and isinstance(obj, type) \
                and obj.__module__ == _METADATA_MODULE:
            return obj
        if (module, name) in _METADATA_GLOBALS:
            return obj
        if module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a "
                                     "DCP checkpoint never holds; refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(os.path.join(str(self.path), name), "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries must load with weights_only=True (plain
    data and tensors); only bytes that passed that are handed to DCP's own loader."""

    def load_bytes(self, read_item, value) -> None:
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # raises on any other object
        super().load_bytes(read_item, io.BytesIO(data))


def safe_load(state: dict, path, process_group=None) -> None:
    """dcp.load that never unpickles arbitrary objects from the checkpoint."""
    import torch.distributed as dist

    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
             process_group=process_group,
             no_dist=process_group is None and not dist.is_initialized())


@dataclass
class PendingSave:
    step: int
    path: Path
    future: Any
    started: float
    contents: tuple


def _state(model, optimizer) -> dict:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _write_side_files(path: Path, lanes: Lanes, trainer_state: dict) -> None:
    rng_dir = path / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, rng_dir / f"rank-{lanes.rank}.pt")
    if lanes.rank == 0:
        atomic_write_text(path / TRAINER_STATE, json.dumps(trainer_state, sort_keys=True))


def _agreed(lanes: Lanes, action) -> None:
    """Run a local filesystem step on every rank and fail on all ranks if any failed:
    a rank that raised alone would leave the others waiting in the next collective."""
    try:
        action()
        error = None
    except OSError as exc:
        error = f"{exc.strerror or exc} ({getattr(exc, 'filename', '') or ''})"
    errors = [e for e in lanes.gather_objects(error) if e]
    if errors:
        raise OSError(errors[0])


def save(root: Path, step: int, model, optimizer, trainer_state: dict, lanes: Lanes,
         async_save: bool = False) -> Optional[PendingSave]:
    """Write step-N; sync saves are committed before returning, async ones return a handle."""
    path = store.step_dir(root, step)

    def make_dir() -> None:
        if lanes.rank == 0:
            if path.exists():  # a torn attempt at this step: never write over it in place
                path.rename(path.with_name(f"{path.name}.torn-{time.time_ns()}"))
            path.mkdir(parents=True)

    _agreed(lanes, make_dir)
    state = _state(model, optimizer)
    contents = tuple(state)
    writer = FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    _agreed(lanes, lambda: _write_side_files(path, lanes, trainer_state))
    started = time.perf_counter()
    if async_save:
        future = dcp.async_save(state, storage_writer=writer, process_group=lanes.checkpoint)
        return PendingSave(step, path, future, started, contents)
    dcp.save(state, storage_writer=writer, process_group=lanes.control)
    commit(PendingSave(step, path, None, started, contents), lanes)
    return None


def commit(pending: PendingSave, lanes: Lanes) -> None:
    """Collective: wait for this rank's writes, checksum them, rank 0 writes commit.json."""
    if pending.future is not None:
        pending.future.result()
    mine = store.checksum_files(pending.path, store.files_for_rank(pending.path, lanes.rank))
    gathered = lanes.gather_objects(mine)

    def write_record() -> None:
        if lanes.rank != 0:
            return
        files: dict = {}
        for part in gathered:
            files.update(part)
        rest = [n for n in store.unowned_files(pending.path, lanes.world_size) if n not in files]
        files.update(store.checksum_files(pending.path, rest))
        if store.METADATA not in files:
            raise OSError(f"DCP wrote no {store.METADATA} in {pending.path}; not committing")
        store.write_commit(pending.path, pending.step, files, world_size=lanes.world_size,
                           contents=list(pending.contents), time=time.time(),
                           save_seconds=round(time.perf_counter() - pending.started, 3))
        log.info("checkpoint step-%d committed (%d files)", pending.step, len(files))

    _agreed(lanes, write_record)  # also the barrier: nobody runs ahead of the commit


def choose_resume(root: Path, lanes: Lanes, step: Optional[int] = None) -> Optional[int]:
    """Newest checkpoint whose every file verifies, decided jointly and broadcast."""
    candidates = None
    if lanes.rank == 0:
        committed = store.committed_steps(root)
        candidates = [s for s in committed if step is None or s == step][::-1]
    candidates = lanes.broadcast_object(candidates)
    for cand in candidates:
        path = store.step_dir(root, cand)
        record = store.read_commit(path)
        names = sorted(record["files"]) if record else []
        problems = store.verify_files(path, names[lanes.rank::lanes.world_size], record) \
            if record else ["commit.json unreadable"]
        all_problems = [p for part in lanes.gather_objects(problems) for p in part]
        if not all_problems:
            return cand
        if lanes.rank == 0:
            log.warning("checkpoint step-%d fails verification, skipping: %s", cand,
                        "; ".join(all_problems[:5]))
    return None


def load(root: Path, step: int, model, optimizer, lanes: Lanes) -> dict:
    """Restore model (+ optimizer if saved) into the already-sharded model; return trainer state."""
    path = store.step_dir(root, step)
    record = store.read_commit(path) or {}
    with_optim = optimizer is not None and "optim" in record.get("contents", ["model", "optim"])
    state = _state(model, optimizer if with_optim else None)
    safe_load(state, path, process_group=lanes.control)
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    rng_file = path / "rng" / f"rank-{lanes.rank}.pt"
    if rng_file.exists() and record.get("world_size") == lanes.world_size:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    trainer_file = path / TRAINER_STATE
    return json.loads(trainer_file.read_text()) if trainer_file.exists() else {}


def full_model_state(model) -> dict:
    """Full (unsharded) weights on every rank, on CPU: for prediction on one process."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, _ = get_state_dict(model, [], options=opts)
    return msd
