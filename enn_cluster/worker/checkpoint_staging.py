"""Staging for async checkpoints: copy only the bytes this rank writes, into buffers that
live as long as the trainer (pinned on GPU hosts) and exist before the first save.

With HSDP every replica holds the same shard; DCP's global plan gives each replicated item
to one rank (`dedup_save_plans`). Staging therefore happens in the planner, once that plan
is known (`finish_plan`): a rank copies the items it will write, nothing else, and the
writer reads them from the copies. `StagingBuffers.reserve` runs the same planning at
start and allocates the buffers, so that the first save allocates nothing (at 8B a
`cudaHostAlloc` of gigabytes inside a step).
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from enn_cluster.worker.fault_injection import staging_delay_s

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _key(index) -> tuple:
    return index.fqn, None if index.offset is None else tuple(index.offset)


class StagingBuffers:
    """CPU copies of the items this rank writes, keyed by (fqn, offset), reused from save to
    save. `allocations`/`allocated_bytes` count every buffer made; `staged_bytes` is what
    the last save copied."""

    def __init__(self, pinned: Optional[bool] = None) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.buffers: dict = {}
        self.allocations = 0
        self.allocated_bytes = 0
        self.staged_bytes = 0

    def buffer_for(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
            self.buffers[key] = buf
            self.allocations += 1
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def reserve(self, state: dict, lanes) -> int:
        """Collective over the control lane: plan a save of `state` as DCP would (replicas
        deduplicated) and allocate this rank's buffers. Returns the bytes reserved."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, lanes.rank == 0)
        plans = lanes.gather_objects(planner.create_local_plan())
        mine = planner.create_global_plan(plans)[0][lanes.rank]
        before = self.allocated_bytes
        for item in mine.items:
            if item.type != WriteItemType.BYTE_IO:
                self.buffer_for(_key(item.index), planner.lookup_object(item.index))
        return self.allocated_bytes - before

    def stage(self, planner: DefaultSavePlanner, items: list, ready=None,
              device=None) -> dict:
        """Copy `items` (this rank's final plan) out of the planner's live state: tensors
        into the buffers (on CUDA on a side stream after the `ready` event, waited for
        here), other objects deep-copied (a scheduler may change them later)."""
        staged, pairs, total = {}, [], 0
        for item in items:
            key = _key(item.index)
            live = DefaultSavePlanner.lookup_object(planner, item.index)
            if item.type == WriteItemType.BYTE_IO:
                staged[key] = copy.deepcopy(live)
                continue
            live = live.detach()
            buf = self.buffer_for(key, live)
            pairs.append((buf, live))
            staged[key] = buf
            total += buf.numel() * buf.element_size()
        if ready is None:
            for buf, live in pairs:
                buf.copy_(live)
        else:
            side = torch.cuda.Stream(device)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                for buf, live in pairs:
                    buf.copy_(live, non_blocking=self.pinned)
            side.synchronize()
        self.staged_bytes = total
        return staged

    def close(self) -> None:
        self.buffers.clear()


class StagingPlanner(DefaultSavePlanner):
    """DCP's default save planner that stages this rank's final plan into `buffers` as
    soon as it is known and serves the writer from the copies; `on_staged` is called
    once the live state may change again (also when staging failed)."""

    def __init__(self, buffers: StagingBuffers, on_staged: Callable[[], None],
                 ready=None, device=None) -> None:
        super().__init__()
        self._buffers, self._on_staged = buffers, on_staged
        self._ready, self._device = ready, device
        self._staged: dict = {}

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        try:
            time.sleep(staging_delay_s())  # tests only
            self._staged = self._buffers.stage(self, plan.items, self._ready, self._device)
        finally:
            self._on_staged()
        return plan

    def lookup_object(self, index):
        staged = self._staged.get(_key(index))
        return staged if staged is not None else super().lookup_object(index)


def reserve_state(model, optimizer, state_of) -> dict:
    """What the first save will hold, without creating optimizer state (that would take an
    optimizer step): the real state once the optimizer has one (a resume), else the model's
    with AdamW's moments standing in as its own parameters (same shape, dtype and shards)
    and its step counter as a scalar. Another optimizer's state is staged at the first save."""
    if optimizer is None or optimizer.state:
        return state_of(model, optimizer)
    state = state_of(model, None)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    moments = ADAM_MOMENTS + (("max_exp_avg_sq",) if optimizer.defaults.get("amsgrad") else ())
    step = torch.zeros((), dtype=torch.float32)
    state["optim"] = {"state": {name: {"step": step, **{m: value for m in moments}}
                                for name, value in state["model"].items() if name in trained}}
    return state
