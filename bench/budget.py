"""How many repeats and extra rounds fit in `python -m bench.run --budget MINUTES`.

COSTS holds each benchmark's estimated seconds on 2 quiet cores at the full sizes: a
fixed part (set-up, the sides that do not repeat) and a part per repeat of `ctx.repeats`
(0 where a benchmark keeps its own count). They come from what each benchmark really took
in the last full runs (results.json's `bench_seconds`, 2026-11-26), rounded up; correct
them from there when a benchmark changes. The pure functions here choose; run.py measures
and asks.
"""
from __future__ import annotations

from typing import Iterable

DEFAULT_BUDGET_MIN = 35.0  # the default full run, on 2 quiet cores (LM overhead in fp32 and bf16)
MIN_REPEATS = 3  # fewer gives no interval for the median
MAX_REPEATS = 5

# name -> (fixed s, s per repeat); one entry per runner (named by its first --only name)
COSTS = {
    "checkpoint": (140.0, 0.0),  # 19 repeats of save/load/resume at 1.6 GB, 5 at 0.4 GB, async
    "staging": (2.0, 0.5),
    "text_staging": (10.0, 25.0),  # 200,000 documents tokenized twice per repeat
    "collect": (3.0, 2.0),
    "overhead": (15.0, 58.0),  # a short warm-up, one pair of 100-step 4-process runs per repeat
    "lm_overhead": (290.0, 74.0),  # fp32: a pair of 40-step 4-process runs per repeat; bf16: 3 pairs
    "prefetch": (4.0, 3.0),
    "predict": (10.0, 22.0),  # world 1, world 2 and the bare loop per repeat
    "metadata": (40.0, 0.0),
    "recovery": (125.0, 0.0),  # 3 pairs of kill-and-restart runs
    "control": (350.0, 0.0),  # 64 .. 1,024 simulated ranks, 3 repeats each
    "submit": (180.0, 0.0),  # a 3-node dev Slurm cluster (root only), 3 pairs, 2 node losses
    "cli": (3.0, 1.0),
    "hf_export": (120.0, 60.0),  # named only; two 1-step trainings, per repeat 4 exports of 182 MB
    "gpu": (0.0, 0.0),  # skipped without CUDA; on a GPU machine it runs alone (--only gpu)
    "scale": (600.0, 0.0),
}


def cost(name: str, repeats: int) -> float:
    fixed, per = COSTS.get(name, (60.0, 0.0))
    return fixed + per * repeats


def estimate(names: Iterable[str], repeats: int) -> float:
    return sum(cost(n, repeats) for n in names)


def choose_repeats(names: list[str], budget_s: float) -> int:
    """The most repeats (MIN_REPEATS .. MAX_REPEATS) whose first rounds fit the budget;
    MIN_REPEATS when none does (the run then says it will overrun)."""
    for repeats in range(MAX_REPEATS, MIN_REPEATS - 1, -1):
        if estimate(names, repeats) <= budget_s:
            return repeats
    return MIN_REPEATS


def slowdown(spent: dict, repeats: int) -> float:
    """How much slower than the estimates this machine runs today (>= 1): the benchmarks
    done so far, their time over their estimate."""
    est = sum(cost(n, repeats) for n in spent)
    return max(1.0, sum(spent.values()) / est) if est > 0 else 1.0


def round_fits(name: str, rest: list[str], repeats: int, elapsed_s: float, spent: dict,
               budget_s: float, last_round_s: float = 0.0) -> bool:
    """Another round of `name` fits when it (as long as its last round took, or its
    estimate, whichever is longer) and the first rounds of the benchmarks still to come
    (`rest`), at today's slowdown, end within the budget."""
    factor = slowdown(spent, repeats)
    again = max(factor * cost(name, repeats), last_round_s)
    return elapsed_s + again + factor * estimate(rest, repeats) <= budget_s
