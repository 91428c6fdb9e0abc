"""Results of a benchmark: per-repeat samples, their summary, the target and the verdict.

A `Result` holds what the target is judged on (`samples`: per-repeat ratios, or seconds
for an absolute target), the two series it came from (ours and the baseline, each with
its unit), and a note saying how it was measured. The median decides pass/miss.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b,
       "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def summary(values: Iterable[float]) -> dict:
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(vals), "min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def median_interval(values: Iterable[float], confidence: float = 0.9) -> Optional[tuple]:
    """A distribution-free interval for the median: order statistics k and n+1-k, with the
    largest k whose binomial coverage is still >= `confidence` (n=5: min..max, 94 %;
    n=10: 2nd..9th, 98 %). (lo, hi, coverage), or None below 3 samples."""
    from math import comb

    vals = sorted(float(v) for v in values)
    n = len(vals)
    if n < 3:
        return None
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2 ** n
        if coverage < confidence:
            break
        best = (vals[k - 1], vals[n - k], coverage)
    return best or (vals[0], vals[-1], 1 - 2 / 2 ** n)


@dataclass
class Series:
    label: str  # what was measured, e.g. "raw tofile+fsync"
    unit: str  # "s", "MB/s", "steps/s"
    values: list = field(default_factory=list)

    def median(self) -> Optional[float]:
        return summary(self.values)["median"]


@dataclass
class Result:
    bench: str  # the --only name that produces it
    name: str
    op: Optional[str] = None  # ">=", "<=", "<" or None (informational)
    target: Optional[float] = None
    unit: str = "x"  # unit of samples and target: "x" (a ratio) or "s"
    samples: list = field(default_factory=list)
    ours: Optional[Series] = None
    baseline: Optional[Series] = None
    note: str = ""
    skipped: str = ""  # why it was not measured
    check_failed: str = ""  # a non-timing check that failed (counts as a miss)
    floor: Optional[float] = None  # ">=" only: the median's 90 % interval must start here too

    @property
    def failed(self) -> bool:
        return self.skipped.startswith("failed:")

    @property
    def verdict(self) -> str:
        if self.failed:
            return "failed"
        if self.skipped:
            return "not measured"
        if self.check_failed:
            return "miss"
        if self.op is None:
            return "info"
        med = summary(self.samples)["median"]
        if med is None:
            return "not measured"
        if not OPS[self.op](med, self.target):
            return "miss"
        interval = median_interval(self.samples)
        low_end_short = self.floor is not None and interval is not None and interval[0] < self.floor
        return "miss" if low_end_short else "pass"

    @property
    def straddles(self) -> bool:
        """The median's interval holds the target (or the floor): more repeats could change
        the verdict."""
        if self.op is None or self.skipped or self.check_failed:
            return False
        interval = median_interval(self.samples)
        return interval is not None and any(interval[0] <= t <= interval[1]
                                            for t in (self.target, self.floor) if t is not None)

    def merge(self, more: "Result") -> None:
        """Add another round's repeats of the same figure (run.py's extra rounds)."""
        self.samples += more.samples
        for key in ("ours", "baseline"):
            mine, theirs = getattr(self, key), getattr(more, key)
            if mine is not None and theirs is not None:
                mine.values += theirs.values

    def target_text(self) -> str:
        if self.op is None:
            return "info"
        unit = " s" if self.unit == "s" else ""
        floor = "" if self.floor is None else f", 90 % interval >= {self.floor:g}"
        return f"{self.op} {self.target:g}{unit}{floor}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["summary"] = summary(self.samples)
        out["median_interval"] = median_interval(self.samples)
        out["straddles"] = self.straddles
        out["verdict"] = self.verdict
        out["target_text"] = self.target_text()
        for key in ("ours", "baseline"):
            if out[key] is not None:
                out[key]["summary"] = summary(out[key]["values"])
        return out


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-repeat ratios of paired samples (each pair measured back to back)."""
    return [n / d for n, d in zip(numerators, denominators) if d]


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def throughput(bench: str, name: str, op: Optional[str], target: Optional[float], nbytes: int,
               ours: tuple, baseline: tuple, note: str, floor: Optional[float] = None) -> Result:
    """A ratio of throughputs: `ours`/`baseline` are (label, seconds per repeat) moving
    the same `nbytes`; samples are baseline time / our time, series in MB/s."""
    mbps = lambda secs: [nbytes / 1e6 / s for s in secs]  # noqa: E731
    return Result(bench, name, op, target, samples=ratios(baseline[1], ours[1]),
                  ours=Series(ours[0], "MB/s", mbps(ours[1])),
                  baseline=Series(baseline[0], "MB/s", mbps(baseline[1])), note=note,
                  floor=floor)


def settle() -> None:
    """Flush every dirty page before a timed side: on this VM the previous side's (or a
    previous benchmark's) writeback otherwise lands on whoever runs next."""
    os.sync()


def alternating(pairs: int):
    """(i, "ours" | "bare") in ABBA order, each after `settle()`: drift on a shared machine
    lands on both sides alike."""
    for i in range(pairs):
        for side in (("ours", "bare") if i % 2 == 0 else ("bare", "ours")):
            settle()
            yield i, side


def drop_cache(paths: Iterable[Path]) -> None:
    """Evict the files' clean pages from the page cache (posix_fadvise DONTNEED).

    Needs no root and touches nothing but these files; pages must be clean (fsynced).
    """
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError):
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in files_under(root))


@dataclass
class BenchContext:
    """What every benchmark gets: the mode, a scratch directory, the repository root."""

    quick: bool
    workdir: Path  # scratch space on the disk under test; removed at the end
    root: Path  # the repository (PYTHONPATH for subprocesses)
    python: str  # the interpreter that runs the CLI and workers
    repeats: int

    def log(self, message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)

    def subprocess_env(self, **extra) -> dict:
        env = dict(os.environ, PYTHONPATH=str(self.root), OMP_NUM_THREADS="1")
        env.update({k: str(v) for k, v in extra.items()})
        return env


def mlp_run(ctx: "BenchContext", name: str, s: dict, x: Path, y: Path, **sections) -> dict:
    """An `enn-submit train` config: the MLP of `s` on regression_arrays' data, the same
    optimizer settings as the bare loop; `sections` add to (training) or set the rest."""
    training = {"max_steps": s.get("steps", 1), "per_device_train_batch_size": s["batch"],
                "lr": s["lr"], "weight_decay": 0.0, "grad_clip": 1.0, "seed": s["seed"],
                **sections.pop("training", {})}
    return {"run_name": name, "runs_root": str(ctx.workdir / "runs"),
            "model": {"name": "mlp", "hidden_sizes": s["hidden"]},
            "data": {"train_path": str(x), "train_targets_path": str(y), "eval_fraction": 0.0},
            "training": training, "logging": {"every_steps": 1}, **sections}


def regression_arrays(base: Path, rows: int, features: int, seed: int) -> tuple[Path, Path]:
    """x.npy / y.npy of a smooth regression task, the data both sides of a benchmark train on."""
    import numpy as np

    base.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = np.tanh(x[:, :8]).sum(axis=1, keepdims=True).astype(np.float32)
    np.save(base / "x.npy", x)
    np.save(base / "y.npy", y)
    return base / "x.npy", base / "y.npy"
