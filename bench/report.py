"""Write the results: `results.json` (everything, per repeat) and `results.md` (the table)."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Optional

from .measure import Result, median_interval, summary


def _num(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.3f}"
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def _series(series) -> str:
    if series is None:
        return "-"
    return _num(summary(series.values)["median"], series.unit)


def table(results: list[Result]) -> str:
    lines = ["| benchmark | target | measured: median [min - max] | median's 90 % interval | "
             "ours (median) | baseline (median) | result |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        s = summary(r.samples)
        interval = median_interval(r.samples)
        if r.skipped:
            measured = r.skipped
        elif s["median"] is None:
            measured = "-"
        else:
            measured = (f"{_num(s['median'], r.unit)} [{_num(s['min'], r.unit)} - "
                        f"{_num(s['max'], r.unit)}] (n={s['n']})")
        ci = (f"{_num(interval[0], r.unit)} - {_num(interval[1], r.unit)}"
              if interval and not r.skipped else "-")
        verdict = f"**{r.verdict}**" + (" (interval holds the target)" if r.straddles else "")
        lines.append(f"| {r.name} | {r.target_text()} | {measured} | {ci} | "
                     f"{_series(r.ours)} | {_series(r.baseline)} | {verdict} |")
    return "\n".join(lines)


def notes(results: list[Result]) -> str:
    out = []
    for r in results:
        parts = []
        if r.ours is not None:
            parts.append(f"ours = {r.ours.label}")
        if r.baseline is not None:
            parts.append(f"baseline = {r.baseline.label}")
        if r.note:
            parts.append(r.note)
        if parts:
            out.append(f"- **{r.name}**: " + "; ".join(parts) + ".")
    return "\n".join(out)


def git_state(root: Path = Path(__file__).resolve().parents[1]) -> dict:
    """Which code was measured: HEAD and the enn_cluster files that differ from it."""
    import subprocess

    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "enn_cluster").splitlines()]
    return {"head": git("rev-parse", "--short", "HEAD").strip() or None,
            "enn_cluster_uncommitted": dirty}


def machine() -> dict:
    import os

    return {"host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_avg": os.getloadavg(), "git": git_state()}


def write(results: list[Result], out_dir: Path, quick: bool, elapsed: float,
          stem: str = "results", busy_at_start: Optional[float] = None,
          bench_seconds: Optional[dict] = None) -> str:
    info = machine()
    git = info.get("git") or {}
    code = (f"code at {git.get('head')}" + (f" + uncommitted changes in "
            f"{len(git['enn_cluster_uncommitted'])} enn_cluster file(s)"
            if git.get("enn_cluster_uncommitted") else "")) if git.get("head") else "code: unknown"
    busy = (f"; BUSY at the start: load average {busy_at_start:.2f} on {info['cpus']} "
            "CPUs, ratios are noisier than usual" if busy_at_start is not None
            else "; quiet at the start: load average at most the CPU count")
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {info['cpus']} CPUs "
              f"(load average at the end {info['load_avg'][0]:.2f}{busy}), "
              f"{'--quick' if quick else 'full'} run, {elapsed:.0f} s; {code}.")
    text = f"{header}\n\n{table(results)}\n\n{notes(results)}\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(text)
    doc = {"quick": quick, "elapsed_s": round(elapsed, 1), "machine": info,
           "busy_at_start": busy_at_start, "bench_seconds": bench_seconds or {},
           "time": time.time(), "results": [r.to_dict() for r in results]}
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    return text
