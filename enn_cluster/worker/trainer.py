"""The training loop: epochs or max_steps, accumulation, clipping, warmup + cosine,
validation, a non-finite guard, metrics, checkpoints and agreed stops.

Every decision that must be the same on all ranks (stop now, commit an async save, skip
a non-finite step) is taken from a collective, never from local state alone. A step has
two small collectives beyond FSDP's own: one accelerator-lane all-reduce that carries the
gradient norm and the loss sum (StepNorm), and one control-lane all-reduce of the
stop/save flags, run alongside it.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import asdict, replace

import numpy as np
import torch

from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.schedule import BatchPlan, lr_at, pause_step, plan_batch, total_steps
from enn_cluster.errors import UserError
from enn_cluster.models import input_dtype, loss_weight, model_loss
from enn_cluster.storage import commits as store
from enn_cluster.storage import node_loss
from enn_cluster.storage import oom_record
from enn_cluster.storage.metrics import MetricsLog, peak_memory_mb
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.staging import open_array, read_manifest
from enn_cluster.storage.tracking import worker_sink
from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.environment import WorkerEnv
from enn_cluster.worker.evaluation import eval_arrays, mean_eval_loss
from enn_cluster.worker.fault_injection import (
    maybe_inject_fault,
    maybe_inject_oom,
    test_faults,
)
from enn_cluster.worker.lanes import Lanes
from enn_cluster.storage.base_weights import check_same_base
from enn_cluster.worker.lm_weights import frozen_base_identity
from enn_cluster.worker.loader import BatchLoader, gather_rows
from enn_cluster.worker.model_setup import autocast, build_sharded_model, gradient_sync
from enn_cluster.worker import oom_governor
from enn_cluster.worker.nonfinite import NonFiniteWatch
from enn_cluster.worker.nonfinite_policy import abort_reason, report_skipped
from enn_cluster.worker.parallel import float8_scales
from enn_cluster.worker.profiling import StepProfiler
from enn_cluster.worker.resume_plan import replan_after_resume
from enn_cluster.worker.saving import Saver, TrainingAborted
from enn_cluster.worker.sampler import (
    DataPosition,
    advance,
    epoch_permutation,
    micro_batch_rows,
)
from enn_cluster.worker.step_math import (
    GC_EVERY_STEPS,
    Cadence,
    StepNorm,
    apply_hyperparameters,
    new_optimizer,
    scheduled_gc,
)
from enn_cluster.worker.stop_request import StopPoller
from enn_cluster.worker.stop_signals import arm_hard_exit, install_stop_handlers
from enn_cluster.worker.watchdog import COMPILE_GRACE_S, Progress, Watchdog, rank_log_stream

log = logging.getLogger("enn_cluster.worker.trainer")


class Trainer:
    def __init__(self, cfg: RunConfig, run: RunDir, env: WorkerEnv, lanes: Lanes):
        self.cfg, self.run, self.env, self.lanes = cfg, run, env, lanes
        self.manifest = read_manifest(run.data_dir)
        self.x = open_array(run.data_dir, "train_x")
        self.y = open_array(run.data_dir, "train_y")
        self.rows = self.manifest["train_rows"]
        self.eval_x, self.eval_y, self.eval_rows = eval_arrays(self.manifest, run.data_dir,
                                                           self.x, self.y)
        scaler = self.manifest.get("target_scaler")
        self.scaler = ({k: np.asarray(v, np.float32) for k, v in scaler.items()}
                       if scaler else None)
        self.sm = build_sharded_model(cfg, self.manifest, env, lanes, self.x.shape[1:])
        t = cfg.training
        self.optimizer = new_optimizer([p for p in self.sm.model.parameters() if p.requires_grad],
                                       t)
        self.base_weights = frozen_base_identity(cfg, self.sm.model, lanes)
        self.n_rows = self.rows[1] - self.rows[0]
        oom_governor.refuse_after_floor(run.path)
        self.micro_cap = oom_record.micro_batch_cap(run.path)  # the OOM governor's
        self.batch = self._plan(t)
        self.total_steps = total_steps(t, self.n_rows, self.batch.global_batch)
        self.step, self.pos = 0, DataPosition()
        dev = lanes.device  # non-finite counters live on the device, read at log steps
        self.nonfinite_in_row = torch.zeros((), dtype=torch.int64, device=dev)
        self.skipped = torch.zeros((), dtype=torch.int64, device=dev)
        self.skipped_seen = 0
        self.stop_requested, self.stop_signal = 0, None
        self.faults = test_faults()  # ENN_TEST_FAULTS, read once
        self.cadence = Cadence(cfg.logging.steps_on(dev.type),  # 10 on GPU: a read syncs
                               cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes)
        self.nonfinite = NonFiniteWatch(self.sm.model, dev, self.sm.plan.replicate,
                                        self.cadence.log_every)
        self.norm = StepNorm(self.nonfinite.params, dev, env.world_size)
        self.unread = None  # a step's loss and norm that no log step read yet (device)
        takes = input_dtype(self.sm.model)
        self.loader = BatchLoader(
            lambda rows, alloc=None: gather_rows(self.x, self.y, rows, self.scaler, alloc, takes),
            lanes.device)
        self.metrics = MetricsLog(run.path / cfg.logging.metrics_path, enabled=lanes.rank == 0,
                                  sink=worker_sink(cfg, run, lanes.rank))
        self.saver = Saver(cfg, run, lanes, self.metrics)
        self.profiler = StepProfiler(cfg.profiling.window, run.path, lanes.rank, lanes.device)
        self.progress = Progress()  # what the watchdog and a failure dump report

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.pos.epoch, "consumed": self.pos.consumed,
                "nonfinite_in_row": int(self.nonfinite_in_row), "skipped": int(self.skipped),
                "world_size": self.env.world_size, "seed": self.cfg.training.seed,
                "global_batch": self.batch.global_batch, "total_steps": self.total_steps,
                "target_scaler": self.manifest.get("target_scaler"),
                "mesh": asdict(self.sm.plan),
                **({"base_weights": self.base_weights} if self.base_weights else {})}

    def load_state_dict(self, state: dict) -> dict:
        """Restore the loop's position and the step budget from it: for an unchanged batch
        the steps done plus the steps left is the uninterrupted run's budget, and after an
        explicit change of the batch (or of training.epochs) the rest is re-planned from
        here. Returns what changed about the batch, for the resume record."""
        t = self.cfg.training
        self.step = int(state.get("step", 0))
        self.pos = DataPosition(int(state.get("epoch", 0)), int(state.get("consumed", 0)))
        self.nonfinite_in_row.fill_(int(state.get("nonfinite_in_row", 0)))
        self.skipped.fill_(int(state.get("skipped", 0)))
        self.skipped_seen = int(state.get("skipped", 0))
        self.batch, self.pos, self.total_steps, changed = replan_after_resume(
            state, t, self.batch, self._plan, self.n_rows, self.step, self.pos)
        return changed

    def _plan(self, t) -> "BatchPlan":
        """The batch split, with the micro-batch capped where memory ran out before."""
        if self.micro_cap:
            t = replace(t, per_device_train_batch_size=min(self.micro_cap,
                                                            t.per_device_train_batch_size))
        return plan_batch(t, self.sm.dp_size, self.env.local_world_size)

    # -- data ----------------------------------------------------------------------------
    def _step_rows(self, perm: np.ndarray, pos: DataPosition) -> list[np.ndarray]:
        """This rank's rows for each micro-batch of the optimizer step starting at `pos`."""
        b = self.batch
        return [micro_batch_rows(perm, pos.consumed, self.lanes.rank, b.dp_size,
                                 b.micro_batch, k) + self.rows[0]
                for k in range(b.accumulation)]

    # -- signals -------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """Ask for an agreed checkpoint-and-exit at the next step boundary. After TERM or
        INT a hard exit follows if that boundary is not reached within
        parallel.stop_grace_s (a peer may be dead)."""
        self.stop_requested = 1
        self.stop_signal = signum
        log.warning("signal %d received: checkpoint at the next step boundary", signum)
        arm_hard_exit(signum, self.cfg.parallel.stop_grace_s)

    def install_signal_handlers(self) -> None:
        """USR2 (Slurm's warning before the time limit), TERM (preemption, scancel, a
        launcher stopping) and INT (Ctrl-C reaching the workers through a launcher) all
        mean the same: checkpoint at the next step boundary and exit 75."""
        install_stop_handlers(lambda signum: self.request_stop(signum))

    # -- loop ----------------------------------------------------------------------------
    def train_step(self, perm: np.ndarray, flags: tuple = (), log_step: bool = True) -> dict:
        """One optimizer step. `flags` (0/1 per rank, host values) ride on the step's one
        control-lane all-reduce; stats["agreed"] says which any rank raised. Loss,
        gradient norm and the non-finite decision stay on the device: they are read only
        on a log step (`log_step`), the one device-to-host wait of a step; another step
        leaves them in `self.unread`, for a checkpoint agreed on during the step."""
        t, sm, dev = self.cfg.training, self.sm, self.lanes.device
        started = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, t.lr, t.warmup_ratio, t.min_lr_ratio,
                   t.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
        counted = torch.zeros((), device=dev, dtype=torch.float64)  # learned tokens (rows)
        accum = self.batch.accumulation
        rows = self._step_rows(perm, self.pos)
        step = self.step + 1
        self.progress.at("accelerator", f"step {step}: forward/backward (FSDP all-gather, "
                                        "reduce-scatter)")
        try:
            maybe_inject_oom(self.faults, self.run.path, self.lanes.rank, step)
            for k, (xb, yb) in enumerate(self.loader.batches(rows)):
                with gradient_sync(sm, k == accum - 1), autocast(sm, dev):
                    loss = model_loss(sm.model, self.cfg.model.task, xb, yb)
                    weight = loss_weight(sm.model, yb)
                    (loss * weight).backward()  # a sum: StepNorm.reduce makes the mean
                loss_sum += loss.detach().double() * weight
                counted += weight
        except torch.OutOfMemoryError as exc:
            oom_governor.record(self.run.path, step, self.lanes.rank, self.batch, dev, exc)
        self.progress.at("control", f"step {step}: stop/save decision all-reduce")
        decided = self.lanes.start_sum([float(f) for f in flags])
        self.progress.at("accelerator", f"step {step}: loss and gradient-norm all-reduce")
        shard_norms = self.norm.shard_norms()  # before the clip (see NonFiniteWatch.flags)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm, mean_loss = self.norm.reduce(shard_norms, loss_sum, max_norm, counted)
        finite = torch.isfinite(grad_norm) & torch.isfinite(mean_loss)
        self.nonfinite.observe(self.step, rows, self.nonfinite.flags(shard_norms), finite, lr,
                               grad_norm, mean_loss)
        agreed = decided()
        waited = self.saver.wait_staged()
        self.optimizer.found_inf = (~finite).to(torch.float32)  # fused AdamW skips on device
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sm.float8_scales:
            float8_scales(self.sm.model)
        self.nonfinite_in_row = torch.where(finite, 0, self.nonfinite_in_row + 1)
        self.skipped += (~finite).to(torch.int64)
        stats = {"lr": lr, "agreed": [v > 0 for v in agreed],
                 **({"checkpoint_wait_s": round(waited, 4)} if waited > 1e-3 else {})}
        self.unread = (mean_loss, grad_norm)
        if log_step:
            stats.update(self._read_step())
        elapsed = time.perf_counter() - started
        stats.update(step_time_s=elapsed, samples_per_s=self.batch.global_batch / elapsed)
        return stats

    def _read_step(self) -> dict:
        """The log step's device-to-host read: loss, norm and the non-finite counters."""
        (mean_loss, grad_norm), self.unread = self.unread, None
        skipped = self._check_nonfinite()
        return {"loss": float(mean_loss),
                "grad_norm": float(grad_norm), "skipped": skipped}

    def _check_nonfinite(self) -> int:
        """Read the non-finite counters (on every rank alike); new skips are dumped
        (RUN/nonfinite/step-N.json) and training.nonfinite_policy decides whether to go on.
        Returns the steps skipped so far."""
        t = self.cfg.training
        in_row, skipped = int(self.nonfinite_in_row), int(self.skipped)
        if skipped <= self.skipped_seen:
            return skipped
        report_skipped(self.nonfinite, self.run.path, self.lanes, self.metrics, t,
                       self.sm.use_bf16, self.step, skipped, self.skipped_seen, in_row)
        self.skipped_seen = skipped
        reason = abort_reason(t, in_row, self.step)
        if reason is not None:
            raise TrainingAborted(reason)
        return skipped

    def _write_eval(self, epoch: int) -> None:
        self.metrics.write("eval", step=self.step, epoch=epoch, eval_loss=self.evaluate())
        self.last_eval = self.step

    def evaluate(self) -> float:
        """Mean eval loss; every rank runs the same number of forwards (FSDP collectives)."""
        return mean_eval_loss(self.sm, self.cfg.model.task,
                              self.cfg.training.per_device_train_batch_size, self.eval_x,
                              self.eval_y, self.eval_rows, self.scaler, self.lanes,
                              self.progress, self.step)

    def save(self, async_save: bool) -> None:
        with self.progress.untimed(f"checkpoint step-{self.step} save"):
            self.saver.save(self.step, self.sm.model, self.optimizer, self.state_dict(),
                            async_save)
        self.cadence.saved()

    def resume(self) -> None:
        try:
            found = ckpt.resume(self.run.checkpoints, self.sm.model, self.optimizer, self.lanes)
        except ckpt.NoStepLoads:
            if not self.sm.weights_from_checkpoint:
                raise
            found = None  # its own words below
        if found is None and self.sm.weights_from_checkpoint:  # never train empty storage
            raise UserError(f"checkpoints: no checkpoint of {self.run.path} verifies, and the "
                            "model's weights exist only there (a module given to "
                            "enn_cluster.train); start a new run with enn_cluster.train")
        if found is None:
            return
        step, state = found
        if self.base_weights:
            check_same_base(state.get("base_weights"), self.base_weights, step)
        apply_hyperparameters(self.optimizer, self.cfg.training)
        changed = self.load_state_dict(state)
        b = self.batch
        # an API run's step-0 checkpoint holds the caller's weights: loading it is the
        # run's start, not a restart (status counts resumes without it)
        initial = {"initial_weights": True} if step == 0 and self.sm.weights_from_checkpoint \
            else {}
        self.metrics.write("resume", step=self.step, epoch=self.pos.epoch,
                           world_size=self.env.world_size, from_world=state.get("world_size"),
                           global_batch=b.global_batch, micro_batch=b.micro_batch,
                           accumulation=b.accumulation, **initial, **changed)
        log.info("resumed from step-%d (saved at world %s, now %d): global batch %d = "
                 "%d micro x %d accumulation x %d ranks%s", step, state.get("world_size"),
                 self.env.world_size, b.global_batch, b.micro_batch, b.accumulation, b.dp_size,
                 f"; changed on purpose {changed}" if changed else "")

    def fit(self) -> str:
        """Train to the end ("done") or to an agreed stop ("stopped", checkpoint committed)."""
        self.resume()
        if self.saver.async_periodic:
            self.saver.reserve(self.sm.model, self.optimizer)
        if self.env.relaunch and self.lanes.rank == 0:  # continuing after a lost node
            lost = node_loss.record_relaunch(self.run, self.metrics, str(self.env.job_id),
                                             self.env.relaunch, self.env.world_size, self.step)
            log.info("relaunch %d after losing %s: world %d from step %d", self.env.relaunch,
                     ",".join(lost["lost"]) if lost else "?", self.env.world_size, self.step)
        watchdog = Watchdog(self.progress, self.cfg.parallel.watchdog_limit_s,
                            rank_log_stream()).start()
        try:
            with scheduled_gc():
                return self._loop()
        finally:
            watchdog.stop()

    def _write_start(self) -> None:
        b = self.batch
        self.metrics.write("start", step=self.step, total_steps=self.total_steps,
                           world_size=self.env.world_size, pid=os.getpid(),
                           global_batch=b.global_batch, micro_batch=b.micro_batch,
                           accumulation=b.accumulation)
        if self.micro_cap:
            self.metrics.write("oom_governor", step=self.step, micro_batch=b.micro_batch,
                               accumulation=b.accumulation, global_batch=b.global_batch,
                               micro_batch_cap=self.micro_cap)

    def _loop(self) -> str:
        cfg = self.cfg
        self._write_start()
        perm_epoch, perm = -1, None
        last_saved = self.step if store.latest_committed(self.run.checkpoints) == self.step else -1
        first_step, self.last_eval, every_eval = self.step, -1, cfg.training.eval_every_steps
        stop_file = StopPoller(self.run.path, self.env.job_id, self.env.rank)  # batch shell's USR2
        log_step = True
        until = pause_step(cfg.training.pause_at_step, first_step, self.total_steps)
        while self.step < until and (cfg.training.max_steps or self.pos.epoch < cfg.training.epochs):
            maybe_inject_fault(self.faults, self.run.path, self.lanes.rank, self.step)
            if perm_epoch != self.pos.epoch:
                perm_epoch = self.pos.epoch
                perm = epoch_permutation(self.n_rows, cfg.training.seed, perm_epoch)
            pending_open = self.saver.in_flight()
            self.stop_requested = self.stop_requested or int(stop_file.poll())
            log_step = self.cadence.log_step(self.step + 1, self.total_steps)
            self.profiler.before_step(self.step + 1)
            votes = (self.stop_requested, pending_open, self.cadence.time_due())
            compiling = cfg.training.compile and self.step == first_step  # each process
            with self.progress.longer(COMPILE_GRACE_S if compiling else 0.0):
                stats = self.train_step(perm, votes, log_step)
            stop, still_open, time_due = stats.pop("agreed")
            epoch_before = self.pos.epoch
            self.step += 1
            self._profiled(self.profiler.after_step(self.step, final=stop))
            if self.step % GC_EVERY_STEPS == 0:
                gc.collect()
            self.pos = advance(self.pos, self.n_rows, self.batch.global_batch)
            if self.pos.epoch == perm_epoch:  # the next step's rows gather while this ends
                self.loader.prefetch(self._step_rows(perm, self.pos))
            periodic = self.step < until and (time_due or
                                                         self.cadence.step_due(self.step))
            if (stop or periodic) and not log_step:  # metrics land at every checkpoint
                stats.update(self._read_step())
                log_step = True
            if log_step:
                self.metrics.write("train", step=self.step, epoch=epoch_before,
                                   peak_mem_mb=round(peak_memory_mb(), 1), **stats)
            if self.eval_x is not None and (self.pos.epoch != epoch_before or every_eval and
                                            self.step % every_eval == 0):
                self._write_eval(epoch_before)
            if not still_open:
                self.saver.finish_pending(self.step)
            if stop:
                self.save(async_save=False)
                return "stopped"
            if periodic:
                self.save(async_save=self.saver.async_periodic)
                last_saved = self.step
        self.saver.finish_pending(self.step)
        if self.eval_x is not None and self.step > first_step and self.last_eval != self.step:
            self._write_eval(epoch_before)  # a run ends evaluated, at an epoch's end or not
        self._profiled(self.profiler.after_step(self.step, final=True))
        if not log_step:  # the steps after the last log step (a loop ended by epochs)
            self._check_nonfinite()
        if last_saved != self.step:
            self.save(async_save=False)
        return "paused" if self.step < self.total_steps and until < self.total_steps else "done"

    def _profiled(self, trace) -> None:
        """Every rank wrote its trace at this step: rank 0 records it and uploads the
        folder to MLflow when tracking is on."""
        if trace is None:
            return
        self.lanes.barrier()
        folder = trace.parent
        self.metrics.write("profile", step=self.step,
                           folder=str(folder.relative_to(self.run.path)))
        if self.metrics.sink is not None:
            self.metrics.sink.log_artifacts(folder, f"profiles/{folder.name}")

    def close(self) -> None:
        self.profiler.close()
        self.loader.close()
        self.metrics.close()
        self.saver.close()
