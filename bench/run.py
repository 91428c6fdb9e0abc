"""`python -m bench.run [--quick] [--only NAME[,NAME]]`: run benchmarks, print and write the table.

Names: checkpoint, async, staging, text_staging, collect, overhead, lm_overhead, prefetch,
predict, metadata, recovery, control, submit, cli, gpu (the default set), and scale and
hf_export (only when named; scale never with --quick). Results go to bench/results.json and bench/results.md
(or --out DIR); a selection that includes scale writes results-scale.json/.md instead, so
the long scale run never overwrites the default set's results. Exit code 1 when a benchmark failed to run; a missed target is not an error.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

from . import budget, report
from .measure import BenchContext, Result

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("checkpoint", "async", "staging", "text_staging", "collect", "overhead",
           "lm_overhead", "prefetch", "predict", "metadata", "recovery", "control", "submit",
           "cli", "gpu")
ALL = DEFAULT + ("scale", "hf_export")


def _run_checkpoint(ctx: BenchContext, names: list[str]) -> list[Result]:
    from . import checkpoint

    return checkpoint.run(ctx, [n for n in names if n in ("checkpoint", "async")])


def _run_collect(ctx: BenchContext, names: list[str]) -> list[Result]:
    from . import staging

    return [staging.collect_result(ctx)]


def _module(name: str):
    """The runner of a benchmark module: bench.NAME is imported only when chosen (its
    imports, torch among them, cost nothing otherwise) and its run(ctx) called."""
    def runner(ctx: BenchContext, names: list[str]) -> list[Result]:
        return importlib.import_module(f"{__package__}.{name}").run(ctx)
    return runner


# one runner may serve several names (checkpoint and async share one process group)
RUNNERS = [(("checkpoint", "async"), _run_checkpoint), (("staging",), _module("staging")),
           (("text_staging",), _module("text_staging")),
           (("collect",), _run_collect), (("overhead",), _module("overhead")),
           (("lm_overhead",), _module("lm_overhead")),
           (("prefetch",), _module("prefetch")), (("predict",), _module("predict")),
           (("metadata",), _module("metadata_ops")), (("recovery",), _module("recovery")),
           (("control",), _module("control_plane")), (("submit",), _module("submit_latency")),
           (("cli",), _module("cli_latency")), (("hf_export",), _module("hf_export")),
           (("gpu",), _module("gpu")),
           (("scale",), _module("scale"))]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 1 min)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only these ({', '.join(ALL)}); repeatable or comma-separated")
    p.add_argument("--repeats", type=int, default=None, help="repeats per figure")
    p.add_argument("--budget", type=float, default=budget.DEFAULT_BUDGET_MIN, metavar="MINUTES",
                   help="trade repeats (3..5) and extra rounds for time (default "
                        f"{budget.DEFAULT_BUDGET_MIN:g}; estimated for 2 quiet cores)")
    p.add_argument("--out", type=Path, default=ROOT / "bench", help="where results go")
    p.add_argument("--workdir", type=Path, default=None,
                   help="scratch directory (default: a new one under the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(ALL)}")
    if args.budget <= 0:
        p.error("--budget: must be a positive number of minutes")
    args.names = names or list(DEFAULT)
    return args


EXTRA_ROUNDS = 2  # more interleaved repeats while a median's interval holds its target


def busy_load() -> Optional[float]:
    """The 1-minute load average when it exceeds the core count (else None)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return load if load > cores else None


def failure(exc: BaseException) -> str:
    return " ".join(f"failed: {type(exc).__name__}: {exc}".split())[:300]


def run_with_rounds(ctx: BenchContext, runner, chosen: list[str], rounds: int,
                    more_fits=lambda last_round_s: True) -> list[Result]:
    """Run a benchmark; while a figure's median interval holds its target, run it again
    (up to `rounds` more times, while `more_fits(seconds the last round took)`) and pool the repeats: each round
    alternates its sides, so the pooled repeats stay interleaved. Each round works in its
    own folder under the benchmark's `ctx.workdir`; a round that fails keeps the figures of
    the rounds before it (their notes say so)."""
    import dataclasses

    t0 = time.perf_counter()
    results = runner(ctx, chosen)
    for k in range(1, rounds + 1):
        unsure = [r.name for r in results if r.straddles]
        if not unsure:
            break
        if not more_fits(time.perf_counter() - t0):
            ctx.log(f"the interval of {', '.join(unsure)} holds the target; no time left in "
                    "the budget for another round")
            break
        ctx.log(f"the interval of {', '.join(unsure)} holds the target: another round")
        scratch = ctx.workdir / f"round-{k}"  # a round's runs and files never meet the last's
        scratch.mkdir()
        t0 = time.perf_counter()
        try:
            more = {r.name: r for r in runner(dataclasses.replace(ctx, workdir=scratch), chosen)}
        except Exception as exc:  # the rounds before keep their figures
            traceback.print_exc()
            for r in results:
                r.note = f"{r.note}; extra round {k} {failure(exc)}".lstrip("; ")
            break
        for r in results:
            if r.name in more:
                r.merge(more[r.name])
    return results


def run_all(ctx: BenchContext, runners, names: list[str], rounds: int,
            budget_s: float = float("inf")) -> tuple[list[Result], dict]:
    """Every chosen runner in turn, each in its own scratch folder (ctx.workdir / its
    first name). A runner that fails becomes a "failed: why" result and the rest go on.
    Returns the results and the seconds each runner took (keyed by its first name)."""
    import dataclasses

    started = time.perf_counter()
    todo = [(chosen, runner) for chosen, runner in
            (([n for n in group if n in names], runner) for group, runner in runners) if chosen]
    results: list[Result] = []
    spent: dict = {}
    for i, (chosen, runner) in enumerate(todo):
        key = chosen[0]
        if chosen == ["scale"] and ctx.quick:
            results.append(Result("scale", "scale", skipped="not run with --quick"))
            continue
        t0 = time.perf_counter()
        rest = [c[0] for c, _ in todo[i + 1:]]
        fits = lambda last_round_s: budget.round_fits(  # noqa: E731
            key, rest, ctx.repeats, time.perf_counter() - started, spent, budget_s,
            last_round_s)
        scratch = ctx.workdir / key
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            results += run_with_rounds(dataclasses.replace(ctx, workdir=scratch), runner,
                                       chosen, rounds, fits)
        except (Exception, SystemExit) as exc:  # one broken benchmark must not hide the rest
            traceback.print_exc()
            results += [Result(n, n, skipped=failure(exc)) for n in chosen]
        spent[key] = round(time.perf_counter() - t0, 1)
        ctx.log(f"{', '.join(chosen)} took {spent[key]:.1f} s")
    return results, spent


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="enn-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keys = [group[0] for group, _ in RUNNERS if any(n in args.names for n in group)]
    budget_s = args.budget * 60
    repeats = args.repeats or (3 if args.quick else budget.choose_repeats(keys, budget_s))
    ctx = BenchContext(quick=args.quick, workdir=workdir, root=ROOT, python=sys.executable,
                       repeats=repeats)
    if not args.quick:
        ctx.log(f"{repeats} repeats: about {budget.estimate(keys, repeats) / 60:.0f} min on 2 "
                f"quiet cores before extra rounds (budget {args.budget:g} min)")
    busy = busy_load()
    if busy is not None:
        ctx.log(f"warning: this machine is busy (load average {busy:.2f} on "
                f"{os.cpu_count()} cores): ratios will be noisy; rerun on a quiet machine")
    started = time.perf_counter()
    try:
        results, spent = run_all(ctx, RUNNERS, args.names, 0 if args.quick else EXTRA_ROUNDS,
                                 budget_s)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    stem = "results-scale" if "scale" in args.names else "results"
    text = report.write(results, args.out, args.quick, time.perf_counter() - started, stem=stem,
                        busy_at_start=busy, bench_seconds=spent)
    print()
    print(text)
    print(f"written: {args.out / (stem + '.md')}, {args.out / (stem + '.json')}")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
