"""Worker side of prediction: load a checkpoint, infer this rank's chunks, commit them.

Every rank holds a whole replica of the chosen checkpoint's weights in the inference dtype
(bf16 where configured: see predict_weights for where each dtype lives) and runs it alone:
inference needs no collective per batch, so ranks with more rows never hold up ranks with
fewer, and a restarted job only redoes chunks that have no commit record.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from enn_cluster.errors import UserError
from enn_cluster.models import input_dtype, kind_of
from enn_cluster.storage import prediction_collapse
from enn_cluster.storage import prediction_manifest as pm
from enn_cluster.storage.checksum import file_checksum
from enn_cluster.storage.rundir import RunDir, atomic_write_text, fsync_dir
from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.fault_injection import maybe_exit_after_chunks
from enn_cluster.worker.loader import host_rows
from enn_cluster.worker.model_setup import use_bf16
from enn_cluster.worker.predict_weights import load_replica

log = logging.getLogger("enn_cluster.worker.predict")


def summarised(values) -> np.ndarray:
    """The [rows, outputs] a chunk's statistics cover: at most a row's first
    pm.STATS_OUTPUTS values (a language model's logits are [tokens x vocab] per row: per-output
    lists of those would make a manifest of tens of MB)."""
    return values.reshape(len(values), -1)[:, :pm.STATS_OUTPUTS]


def chunk_stats(values: np.ndarray) -> dict:
    """Per-output count/mean/M2/min/max/non-finite of one chunk (finite values only)."""
    flat = summarised(values).astype(np.float64)
    finite = np.isfinite(flat)
    clean = np.where(finite, flat, np.nan)
    count = int(finite.all(axis=1).sum()) if flat.size else 0
    with np.errstate(all="ignore"):
        mean = np.nan_to_num(np.nanmean(clean, axis=0)) if count else np.zeros(flat.shape[1])
        m2 = np.nansum((clean - mean) ** 2, axis=0) if count else np.zeros(flat.shape[1])
    return {"count": count, "mean": mean.tolist(), "m2": m2.tolist(),
            "min": np.nan_to_num(np.nanmin(clean, axis=0), nan=0.0).tolist() if count else [0.0] * flat.shape[1],
            "max": np.nan_to_num(np.nanmax(clean, axis=0), nan=0.0).tolist() if count else [0.0] * flat.shape[1],
            "nonfinite": (~finite).sum(axis=0).astype(int).tolist()}


def denormalise(raw: np.ndarray, scaler) -> np.ndarray:
    if not scaler:
        return raw
    shape = raw.shape
    flat = raw.reshape(len(raw), -1)
    mean, std = np.asarray(scaler["mean"], np.float32), np.asarray(scaler["std"], np.float32)
    return (flat * std + mean).astype(np.float32).reshape(shape)


def committed(pdir: Path, spec: pm.ChunkSpec) -> bool:
    """A record that matches its file (size and checksum): never redo that chunk."""
    try:
        rec = pm.read_record(pdir / f"{spec.stem}.json")
        size, checksum = file_checksum(pdir / rec["file"], like=rec["checksum"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, UserError):
        return False
    return size == rec["nbytes"] and checksum == rec["checksum"] and \
        rec["rows"] == [spec.start, spec.stop]


class ChunkWriter:
    """Infers chunks with one replica and commits each: `.npy` by rename, then its record.
    Chunk 0's record carries the precision check (`first_fp32`: rank 0's fp32 output on
    its first batch, when the replica is bf16)."""

    def __init__(self, pdir: Path, model, x, request: dict, lanes, kind,
                 first_fp32=None, sharded: bool = False) -> None:
        self.pdir, self.model, self.x, self.request, self.lanes = pdir, model, x, request, lanes
        self.kind, self.sharded, self.first_fp32 = kind, sharded, first_fp32
        self.dtype = next(model.parameters()).dtype
        self.takes = input_dtype(model)  # token ids stay integers up to the embedding
        self.out_shape = tuple(request["output_shape"])
        # a sharded model's forwards are FSDP2 collectives, which inference mode refuses
        self.grad_mode = torch.no_grad if sharded else torch.inference_mode

    def committed(self, spec: pm.ChunkSpec) -> bool:
        return committed(self.pdir, spec)


    def _forward(self, xb: torch.Tensor, first_row: int) -> torch.Tensor:
        xb = xb.to(self.dtype) if xb.is_floating_point() else xb
        return self.kind.predict(self.model, xb, self.request, first_row, self.sharded).float()

    def infer(self, spec: pm.ChunkSpec) -> tuple[np.ndarray, dict | None, float]:
        """The chunk's raw outputs, the precision check (first batch of chunk 0) and the
        largest spread of any input feature over the chunk's rows (0: identical rows)."""
        out = None  # shaped by the first batch's outputs (see below)
        batch, check, spread, first = int(self.request["batch_size"]), None, 0.0, None
        with self.grad_mode():
            for start in range(spec.start, spec.stop, batch):
                stop = min(start + batch, spec.stop)
                rows = host_rows(self.x[start:stop], self.takes)
                flat = rows.reshape(len(rows), -1)
                lo, hi = flat.min(axis=0), flat.max(axis=0)
                first = flat[0].copy() if first is None else first
                spread = max(spread, float(np.nanmax(np.maximum(hi - first, first - lo),
                                                     initial=0.0)))
                xb = torch.from_numpy(rows).to(self.lanes.device, non_blocking=True)
                yb = self._forward(xb, start)
                if spec.index == 0 and start == spec.start:
                    check = self._precision_check(yb)
                if out is None:
                    out = np.empty((spec.rows,) + self._row_shape(yb), dtype=np.float32)
                out[start - spec.start:stop - spec.start] = \
                    yb.reshape((stop - start,) + out.shape[1:]).cpu().numpy()
        return out, check, spread

    def _row_shape(self, yb: torch.Tensor) -> tuple:
        """A row's output shape: the request's (shaped like the targets) when the outputs have
        that many values per row, else the model's own (a language model's logits are
        [tokens, vocab] where its targets are [tokens]): outputs are written as they are."""
        own = tuple(yb.shape[1:])
        if int(np.prod(own, dtype=np.int64)) == int(np.prod(self.out_shape, dtype=np.int64)):
            return self.out_shape
        log.warning("outputs have shape %s per row, not the targets' %s: written as they are",
                    own, self.out_shape)
        return own

    def _precision_check(self, yb: torch.Tensor) -> dict | None:
        """How far reduced precision is from the fp32 forward pass on the same batch, and
        each output's spread in both (a collapse verdict's fp32 re-run candidate)."""
        if self.dtype == torch.float32:
            return {"reduced_precision": False, "dtype": "float32"}
        if not self.kind.compares_fp32:  # no fp32 replica beside it: the record says which
            return {"reduced_precision": True, "dtype": str(self.dtype).replace("torch.", "")}
        ref, self.first_fp32 = self.first_fp32, None
        if ref is None:  # rank 0 always has it for chunk 0 (run_prediction): be loud
            raise RuntimeError("precision check: no fp32 output for chunk 0's first batch")
        diff = float((ref - yb.cpu()).abs().max()) if yb.numel() else 0.0
        log.info("precision check: max |fp32 - bf16| on the first batch = %.3g", diff)
        flat_ref, flat_red = summarised(ref), summarised(yb.cpu())
        spread = lambda t: t.std(dim=0, correction=0).tolist()  # noqa: E731
        return {"reduced_precision": True, "dtype": "bfloat16", "max_abs_diff": diff,
                "weights_dtype": str(self.dtype).replace("torch.", ""),
                "fp32_mean": flat_ref.mean(dim=0).tolist(), "fp32_std": spread(flat_ref),
                "reduced_std": spread(flat_red)}

    def write(self, spec: pm.ChunkSpec, raw: np.ndarray, check: dict | None,
              input_spread: float, began: float) -> dict:
        """Commit one chunk; its record keeps the seconds from `began` (reading, inferring,
        writing and checksumming it): rows/s per rank, for slow-rank hunts and the bench."""
        path = self.pdir / f"{spec.stem}.npy"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            np.lib.format.write_array(fh, raw, allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        size, checksum = file_checksum(path)
        rec = pm.chunk_record(spec, shape=raw.shape, dtype=raw.dtype.str, checksum=checksum,
                              nbytes=size, rank=self.lanes.rank,
                              stats=chunk_stats(denormalise(raw, self.request.get("scaler"))))
        rec["input_spread"] = input_spread
        rec["seconds"] = round(time.perf_counter() - began, 6)
        if self.request.get("scaler"):  # normalised units: a collapse verdict's raw candidate
            rec["raw_stats"] = chunk_stats(raw)
        if check is not None:
            rec["precision_check"] = check
        atomic_write_text(self.pdir / f"{spec.stem}.json", json.dumps(rec, sort_keys=True))
        return rec


def _idle_forwards(request: dict, pending: list, lanes) -> int:
    """A sharded model's forwards are collectives: the forwards this rank must add to its own
    so that every rank runs as many as the busiest (each rank's count gathered once)."""
    from enn_cluster.worker.lm_predict import forwards

    mine = sum(forwards(request, spec.rows) for spec in pending)
    return max(lanes.gather_objects(mine)) - mine


def run_prediction(run: RunDir, cfg, env, lanes, name: str, step=None) -> None:
    """Collective over all ranks: every chunk committed, then rank 0 commits the manifest."""
    pdir = run.predictions / pm.check_name(name)
    try:
        request = pm.read_request(pdir)
    except FileNotFoundError:
        raise UserError(f"--name: {pdir} holds no prediction request; start it with "
                        f"'enn-submit predict {run.path} --input X.npy --name {name}'")
    chosen = ckpt.choose_resume(run.checkpoints, lanes, step=request["step"])
    if chosen is None:
        raise UserError(f"checkpoint step-{request['step']} of {run.path} is missing or fails "
                        f"verification; see 'enn-submit verify {run.path}'")
    x = np.load(pdir / pm.INPUT, mmap_mode="r")
    dtype = torch.bfloat16 if use_bf16(cfg, lanes.device) else torch.float32
    chunks = pm.plan_chunks(len(x), request["chunk_rows"])
    check_rows = None  # rank 0 owns chunk 0: its first batch gets the fp32 re-run
    first_done = dtype != torch.float32 and lanes.rank == 0 and chunks and \
        committed(pdir, chunks[0])  # checksummed once: the loop below trusts this answer
    if dtype != torch.float32 and lanes.rank == 0 and chunks and not first_done:
        check_rows = np.array(x[:min(int(request["batch_size"]), chunks[0].rows)])
    sharded, kind = bool(request.get("sharded")), kind_of(cfg)
    if sharded or not kind.compares_fp32:
        first_done = False  # no fp32 re-run to skip
    if sharded and kind.predicts_sharded:
        from enn_cluster.worker.lm_predict import sharded_lm

        model = sharded_lm(cfg, run, chosen, env, lanes, x.shape[1:])
        writer = ChunkWriter(pdir, model, x, request, lanes, kind, sharded=True)
    elif kind.weights_dir(cfg) is not None:  # base weights from files, the checkpoint on top
        from enn_cluster.worker.lm_predict import lm_replica

        model = lm_replica(cfg, run.checkpoints, chosen, lanes, env.node_rank, dtype)
        writer = ChunkWriter(pdir, model, x, request, lanes, kind)
    else:
        model, first_fp32 = load_replica(run, cfg, chosen, x.shape[1:], lanes, env.node_rank,
                                         dtype, check_rows if kind.compares_fp32 else None)
        writer = ChunkWriter(pdir, model, x, request, lanes, kind, first_fp32)
    mine = pm.chunks_for_rank(chunks, lanes.rank, lanes.world_size)
    started, written, skipped = time.perf_counter(), 0, 0
    pending = [spec for spec in mine if not ((first_done and spec == chunks[0]) or
                                             writer.committed(spec))]
    idle = _idle_forwards(request, pending, lanes) if sharded else 0
    for spec in mine:
        if spec not in pending:
            skipped += 1
            continue
        began = time.perf_counter()
        raw, check, spread = writer.infer(spec)
        writer.write(spec, raw, check, spread, began)
        written += 1
        maybe_exit_after_chunks(run.path, name, lanes.rank, written)
    if idle:
        from enn_cluster.worker.lm_predict import idle_forwards

        idle_forwards(writer.model, idle, lanes.device)
    log.info("rank %d: %d chunks written, %d already committed, %.2f s", lanes.rank, written,
             skipped, time.perf_counter() - started)
    lanes.barrier()
    if lanes.rank == 0:
        write_manifest(pdir, request, len(x), world_size=lanes.world_size)
    lanes.barrier()


def write_manifest(pdir: Path, request: dict, n_rows: int, world_size: int) -> dict:
    """Gather the chunk records; commit the manifest only when they cover every row once."""
    chunks = pm.plan_chunks(n_rows, request["chunk_rows"])
    records = [pm.read_record(pdir / f"{c.stem}.json") for c in chunks]
    problems = pm.coverage_problems(records, n_rows)
    if problems:
        raise RuntimeError(f"prediction {pdir.name}: " + "; ".join(problems[:5]))
    checks = [r["precision_check"] for r in records if r.get("precision_check")]
    reduced = [c for c in checks if c.get("reduced_precision")]
    manifest = {
        "name": request["name"], "step": request["step"], "n_rows": n_rows,
        "output_shape": list(records[0]["shape"][1:]) if records else request["output_shape"],
        "dtype": records[0]["dtype"] if records else "<f4",
        "chunk_rows": request["chunk_rows"], "scaler": request.get("scaler"),
        "input": request["input"], "world_size": world_size, "time": time.time(),
        "chunks": records, "stats": pm.merge_stats([r["stats"] for r in records]),
        "precision_check": (max(reduced, key=lambda c: c.get("max_abs_diff", 0.0)) if reduced
                            else (checks[0] if checks else None)),
        "raw_stats": pm.merge_stats([r.get("raw_stats") for r in records]),
        "input_spread": max((r.get("input_spread", 0.0) for r in records), default=0.0),
    }
    if request.get("generate"):  # token ids, not values: a spread means nothing here
        manifest["generate"] = request["generate"]
    manifest["collapse"] = None if request.get("generate") else \
        prediction_collapse.verdict(manifest)
    if manifest["collapse"]:
        log.warning("prediction %s is near-constant: %s", request["name"],
                    manifest["collapse"]["message"])
    atomic_write_text(pdir / pm.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    fsync_dir(pdir)
    log.info("prediction %s committed: %d rows in %d chunks", request["name"], n_rows, len(records))
    return manifest
