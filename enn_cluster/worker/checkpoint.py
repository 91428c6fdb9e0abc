"""DCP checkpoints: save into a fresh step directory, commit, choose, load (resharding).

Save: every rank writes its shards (DCP, one file per rank), its RNG state, and rank 0
the trainer state. Commit: each rank checksums the files it wrote, rank 0 gathers them
on the control lane and writes `commit.json` last. Resume: rank 0 lists committed steps;
the newest is loaded while each shard is checksummed by one rank in the same read, and
one that fails falls back to the next older. Loading at another world size reshards
through DTensor metadata. `choose_resume` (verify first, then load) serves prediction.
"""
from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from enn_cluster.errors import UserError
from enn_cluster.storage import commits as store
from enn_cluster.storage.dcp_io import ChecksummingWriter, ShardVerifier, safe_load
from enn_cluster.storage.rundir import atomic_write_bytes, atomic_write_text
from enn_cluster.storage.run_files import open_run_file
from enn_cluster.worker.fault_injection import hold_before_commit
from enn_cluster.worker.lanes import Lanes
from enn_cluster.worker.replica_reads import ReplicaSplitPlanner

log = logging.getLogger("enn_cluster.worker.checkpoint")
TRAINER_STATE = "trainer.json"


@dataclass
class Snapshot:
    """What a checkpoint holds besides tensors, taken when the save is asked for: an async
    write finishes steps later, when the RNG and trainer state have moved on."""
    trainer_state: dict
    rng: dict


def snapshot(trainer_state: dict) -> Snapshot:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return Snapshot(dict(trainer_state), rng)  # Trainer.state_dict() builds fresh values


def state_options(model) -> StateDictOptions:
    """A model with frozen parameters (a LoRA run's base weights) checkpoints only what it
    trains: the frozen ones are rebuilt from their source at every start."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def frozen_names(model) -> set[str]:
    """Every name of a frozen parameter, a tied one under each of its names: torch's
    ignore_frozen_params drops only the first (a tied LoRA base's lm_head.weight, the whole
    vocabulary's embedding, stayed in every checkpoint)."""
    return {name.removeprefix("module.")
            for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def state_of(model, optimizer) -> dict:
    options = state_options(model)
    if optimizer is None:
        msd, _ = get_state_dict(model, [], options=options)
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
    if options.ignore_frozen_params:
        for name in frozen_names(model) & set(msd):
            del msd[name]
    return {"model": msd} if optimizer is None else {"model": msd, "optim": osd}


def _write_side_files(path: Path, lanes: Lanes, snap: Snapshot) -> None:
    rng_dir = path / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(snap.rng, buf)
    atomic_write_bytes(rng_dir / f"rank-{lanes.rank}.pt", buf.getvalue())  # durable before commit
    if lanes.rank == 0:
        atomic_write_text(path / TRAINER_STATE, json.dumps(snap.trainer_state, sort_keys=True))


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
         keep_last: Optional[int] = None, writer_threads: int = 1) -> float:
    """Write and commit step-N from the live state (blocking); then prune to `keep_last`.
    Returns the seconds it took."""
    return write(root, step, state_of(model, optimizer), snapshot(trainer_state), lanes,
                 keep_last, writer_threads)


def report_save_time(metrics, step: int, seconds: float, grace_s: float) -> None:
    """Record how long a save took (a `checkpoint_saved` metrics record; commit.json holds
    it as `save_seconds`), and log and record (`slow_checkpoint`) one longer than the stop
    grace: a stop's save would be cut short by the hard exit (under Slurm, by the time
    limit after USR2; the next submit raises its grace from the commit record)."""
    metrics.write("checkpoint_saved", step=step, seconds=round(seconds, 3))
    warning = store.save_over_grace(step, seconds, grace_s)
    if warning:
        log.warning("%s", warning)
        metrics.write("slow_checkpoint", step=step, seconds=round(seconds, 1),
                      stop_grace_s=grace_s)


def write(root: Path, step: int, state: dict, snap: Snapshot, lanes: Lanes,
          keep_last: Optional[int] = None, writer_threads: int = 1, planner=None) -> float:
    """Collective over `lanes`: fresh step directory, side files, DCP files (one per
    writer thread), commit record, prune. Async saves run this in their own thread on the
    checkpoint lane, with a `planner` that stages what this rank writes. Returns the
    seconds it took."""
    path = store.step_dir(root, step)

    def make_dir() -> None:
        if lanes.rank == 0:
            if path.exists():  # a torn attempt at this step: never write over it in place
                aside = path.with_name(f"{path.name}.torn-{time.time_ns()}")
                path.rename(aside)
                log.warning("%s: an earlier attempt that never committed is set aside as %s "
                            "(pruned once this step commits)", path.name, aside.name)
            path.mkdir(parents=True)

    started = time.perf_counter()
    _agreed(lanes, make_dir)
    _agreed(lanes, lambda: _write_side_files(path, lanes, snap))
    writer = ChecksummingWriter(path, writer_threads)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=lanes.control)
    hold_before_commit(step, lanes.rank)
    _commit(path, step, writer.checksums, tuple(state), started, lanes,
            {k: snap.trainer_state[k] for k in RECORDED if k in snap.trainer_state})
    if keep_last is not None and lanes.rank == 0:
        store.prune(root, keep_last, protect=[step])
    return time.perf_counter() - started


RECORDED = ("base_weights",)  # trainer-state keys the commit record names as well


def _commit(path: Path, step: int, written: dict, contents: tuple, started: float,
            lanes: Lanes, info: Optional[dict] = None) -> None:
    """Collective: gather every rank's checksums, rank 0 writes commit.json last."""
    gathered = lanes.gather_objects(_my_checksums(path, written, lanes.rank))

    def write_record() -> None:
        if lanes.rank != 0:
            return
        n = store.commit_gathered(path, step, gathered, world_size=lanes.world_size,
                                  contents=list(contents), time=time.time(),
                                  save_seconds=round(time.perf_counter() - started, 3),
                                  **(info or {}))
        log.info("checkpoint step-%d committed (%d files)", step, n)

    _agreed(lanes, write_record)  # also the barrier: nobody runs ahead of the commit


def _my_checksums(path: Path, written: dict, rank: int) -> dict:
    """This rank's files, named from what it wrote (no directory listing): DCP's as the
    writer checksummed them (when their size still agrees), the rest (RNG state) read back."""
    out, rest = {}, []
    names = [n for n in written if store.owner_rank(n) == rank] + [f"rng/rank-{rank}.pt"]
    for name in names:
        made = written.get(name)
        if made and (path / name).stat().st_size == made["size"]:
            out[name] = made
        else:
            rest.append(name)
    out.update(store.checksum_files(path, rest))
    return out


def _candidates(root: Path, lanes: Lanes, step: Optional[int] = None) -> list[int]:
    """Committed steps (`step` alone, when given), newest first: listed by rank 0, broadcast."""
    found = None
    if lanes.rank == 0:
        found = [s for s in store.committed_steps(root) if step is None or s == step][::-1]
    return lanes.broadcast_object(found)


def _verified(path: Path, record: Optional[dict], lanes: Lanes, keep=lambda name: True) -> list:
    """Each rank checksums its share of the recorded files that `keep` selects; every
    rank gets all ranks' problems ([]: all verified)."""
    if record is None:
        problems = ["commit.json unreadable"]
    else:
        names = [n for n in sorted(record["files"]) if keep(n)]
        problems = store.verify_files(path, names[lanes.rank::lanes.world_size], record)
    return [p for part in lanes.gather_objects(problems) for p in part]


def _skipped(step: int, problems: list, lanes: Lanes) -> None:
    if lanes.rank == 0:
        log.warning("checkpoint step-%d fails verification, skipping: %s", step,
                    "; ".join(problems[:5]))


def choose_resume(root: Path, lanes: Lanes, step: Optional[int] = None) -> Optional[int]:
    """Newest checkpoint whose every file verifies, decided jointly and broadcast."""
    for cand in _candidates(root, lanes, step):
        path = store.step_dir(root, cand)
        problems = _verified(path, store.read_commit(path), lanes)
        if not problems:
            return cand
        _skipped(cand, problems, lanes)
    return None


class NoStepLoads(UserError):
    """Committed steps, none of which loads: a resume from scratch would write over them."""


class CorruptCheckpoint(Exception):
    """Shards whose bytes, read while loading, disagree with the commit record."""

    def __init__(self, problems: list) -> None:
        super().__init__("; ".join(problems[:5]))
        self.problems = problems


def _load_failures(exc: CheckpointException) -> list:
    """One line per failed rank (DCP's own message carries every rank's traceback)."""
    return [f"load failed on rank {r}: {type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0][:200]}" for r, (e, _) in sorted(exc.failures.items())]


def resume(root: Path, model, optimizer, lanes: Lanes,
           report: Optional[dict] = None) -> Optional[tuple[int, dict]]:
    """Load the newest checkpoint that verifies, reading its bytes once: the small files
    (metadata, trainer and RNG state) are verified first, the shards while they load
    (`load(verify_against=record)`). A step that fails either way is skipped for the next
    older one, whose load overwrites everything the failed one wrote. Returns (step,
    trainer state); None when no step was ever committed. Committed steps none of which
    loads (damaged, or a model changed since they were written) are refused: training from
    scratch would write over them."""
    newest = None
    for cand in _candidates(root, lanes):
        path = store.step_dir(root, cand)
        record = store.read_commit(path)
        problems = _verified(path, record, lanes, keep=lambda n: not store.is_shard(n))
        if not problems:
            try:
                return cand, load(root, cand, model, optimizer, lanes, verify_against=record,
                                  report=report)
            except CorruptCheckpoint as exc:
                problems = exc.problems
            except CheckpointException as exc:  # raised on every rank alike
                problems = _load_failures(exc)
        _skipped(cand, problems, lanes)
        newest = newest or (cand, problems)
    if newest is not None:
        step, problems = newest
        raise NoStepLoads(f"checkpoints: no committed step of this run loads (newest, "
                          f"step-{step}: {'; '.join(problems[:2])[:400]}); it would train from "
                          "scratch over them: resume with the model config they were saved "
                          "with, restore the checkpoint directory, or start a new run")
    return None


def load(root: Path, step: int, model, optimizer, lanes: Lanes,
         verify_against: Optional[dict] = None, report: Optional[dict] = None) -> dict:
    """Restore model (+ optimizer if saved) into the already-sharded model; return trainer
    state. `verify_against` (the step's commit record): every shard is checksummed by one
    rank as it is read (raises CorruptCheckpoint on every rank before anything but the
    tensors was restored). Each replicated shard is read once per replica group
    (replica_reads). `report`, when given, receives the bytes read from the filesystem
    (all ranks) and the bytes of the step's shard files."""
    path = store.step_dir(root, step)
    record = verify_against or store.read_commit(path) or {}
    with_optim = optimizer is not None and "optim" in record.get("contents", ["model", "optim"])
    state = state_of(model, optimizer if with_optim else None)
    verifier = None if verify_against is None else ShardVerifier(
        record, sorted(record["files"]), lanes.rank, lanes.world_size)
    planner = ReplicaSplitPlanner()
    read = safe_load(state, path, process_group=lanes.control, verifier=verifier,
                     planner=planner)
    problems = [] if verifier is None else verifier.problems(path)
    read += 0 if verifier is None else verifier.bytes_read
    gathered = lanes.gather_objects((problems, read))
    problems = [p for part, _ in gathered for p in part]
    if problems:
        raise CorruptCheckpoint(problems)
    planner.share()
    _note_read(step, sum(n for _, n in gathered), record, lanes.rank, report)
    options = state_options(model)
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={},
                       options=options)
    rng_file = path / "rng" / f"rank-{lanes.rank}.pt"
    if os.path.lexists(rng_file) and record.get("world_size") == lanes.world_size:
        _restore_rng(rng_file)
    trainer_file = path / TRAINER_STATE
    return json.loads(trainer_file.read_text()) if trainer_file.exists() else {}


def _note_read(step: int, read: int, record: dict, rank: int, report: Optional[dict]) -> None:
    shards = sum(info["size"] for name, info in record.get("files", {}).items()
                 if store.is_shard(name))
    if report is not None:
        report.update(bytes_read=read, shard_bytes=shards)
    if rank == 0 and shards:
        log.info("step-%d: %.1f MB read from the filesystem for %.1f MB of shards (%.2fx)",
                 step, read / 1e6, shards / 1e6, read / shards)


def _restore_rng(path: Path) -> None:
    """This rank's RNG state from its file, read as untrusted (weights-only unpickling of a
    regular file): anything else is one line naming the file (exit 2), not a traceback."""
    try:
        with open_run_file(path) as fh:
            rng = torch.load(fh, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a hostile pickle fails in many ways
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Unsupported")),
                   lines[0] if lines else type(exc).__name__)[:200]
        raise UserError(f"{path.parent.parent.name}/rng/{path.name}: not an RNG state this "
                        f"package saves ({why}); restore the checkpoint or start a new run "
                        "from another one") from None


def full_model_state(model) -> dict:
    """Full (unsharded) weights on every rank, on CPU: for prediction on one process."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, _ = get_state_dict(model, [], options=opts)
    return msd
