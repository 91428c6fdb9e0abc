"""The `make bench` harness (bench/run.py, measure.py, report.py, budget.py): argument
parsing, verdicts and floors, the report files, the budget, extra rounds, scratch folders
and failures. Nothing is timed and no benchmark runs (they run only under `make bench`)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import report, run  # noqa: E402
from bench.measure import Result, Series, ratios, summary  # noqa: E402


def test_parse_args_default_set_excludes_scale():
    args = run.parse_args([])
    assert args.names == list(run.DEFAULT)
    assert "scale" not in args.names and not args.quick


def test_parse_args_only_is_repeatable_and_comma_separated():
    args = run.parse_args(["--quick", "--only", "checkpoint,cli", "--only", "async"])
    assert args.quick and args.names == ["checkpoint", "cli", "async"]
    assert run.parse_args(["--only", "scale"]).names == ["scale"]


def test_parse_args_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--only", "checkpoint,nope"])
    assert "nope" in capsys.readouterr().err


def test_verdicts_follow_the_median():
    assert Result("x", "a", ">=", 0.8, samples=[0.7, 0.9, 0.85]).verdict == "pass"
    assert Result("x", "b", "<=", 0.1, samples=[0.2, 0.05, 0.3]).verdict == "miss"
    assert Result("x", "c", samples=[1.0]).verdict == "info"
    assert Result("x", "d", ">=", 0.8, skipped="no GPU").verdict == "not measured"
    assert Result("x", "e", "<", 0.5, unit="s", samples=[0.1],
                  check_failed="torch imported").verdict == "miss"
    assert ratios([1.0, 2.0], [2.0, 0.0]) == [0.5]
    assert summary([]) == {"n": 0, "min": None, "median": None, "max": None}


def test_report_write_on_fake_results(tmp_path):
    results = [
        Result("checkpoint", "save vs raw", ">=", 0.8, samples=[0.9, 0.85, 0.95],
               ours=Series("ours", "MB/s", [900.0, 850.0, 950.0]),
               baseline=Series("raw", "MB/s", [1000.0] * 3), note="fake"),
        Result("cli", "CLI --help", "<", 0.5, unit="s", samples=[0.05, 0.06],
               ours=Series("enn-submit --help", "s", [0.05, 0.06])),
        Result("gpu", "GPU MFU", skipped="skipped: no GPU"),
    ]
    text = report.write(results, tmp_path, quick=True, elapsed=1.0)
    md = (tmp_path / "results.md").read_text()
    assert md == text
    assert "| save vs raw | >= 0.8 | 0.900 [0.850 - 0.950] (n=3) |" in md
    assert "**pass**" in md and "**not measured**" in md and "skipped: no GPU" in md
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["quick"] is True
    assert [r["verdict"] for r in doc["results"]] == ["pass", "pass", "not measured"]
    assert doc["results"][0]["summary"]["median"] == pytest.approx(0.9)
    assert doc["results"][0]["ours"]["summary"]["n"] == 3


def test_median_interval_from_order_statistics():
    from bench.measure import median_interval

    assert median_interval([1.0, 2.0]) is None
    lo, hi, cover = median_interval([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (lo, hi) == (1.0, 5.0) and cover == pytest.approx(1 - 2 / 32)  # n=5: min..max
    lo, hi, cover = median_interval(range(10))
    assert (lo, hi) == (1.0, 8.0) and cover >= 0.9  # n=10: 2nd..9th
    assert Result("x", "a", ">=", 0.8, samples=[0.7, 0.9, 0.85]).straddles
    assert not Result("x", "b", ">=", 0.8, samples=[0.9, 0.95, 0.85]).straddles
    assert not Result("x", "c", samples=[0.7, 0.9, 0.85]).straddles  # info: no target


def test_a_straddling_figure_gets_more_interleaved_rounds(tmp_path):
    """run_with_rounds pools another round's repeats (ours and baseline too) while the
    median's interval holds the target, and stops once it does not."""
    from bench.measure import BenchContext

    rounds = iter([[0.7, 0.9, 0.85], [0.95, 0.96, 0.97], [0.99, 0.98, 0.97], [0.0, 0.0, 0.0]])
    calls = []

    def runner(ctx, chosen):
        calls.append(chosen)
        (ctx.workdir / "run-0").mkdir()  # as a real benchmark makes its runs: once per workdir
        samples = next(rounds)
        return [Result("x", "fig", ">=", 0.8, samples=list(samples),
                       ours=Series("o", "MB/s", list(samples)), baseline=Series("b", "MB/s", [1.0] * 3)),
                Result("x", "info", samples=[1.0])]

    ctx = BenchContext(quick=False, workdir=tmp_path, root=tmp_path, python=sys.executable, repeats=3)
    fig, info = run.run_with_rounds(ctx, runner, ["x"], rounds=2)
    assert len(calls) == 3  # the third round: pooled [0.7 .. 0.99] no longer straddles
    assert fig.samples == [0.7, 0.9, 0.85, 0.95, 0.96, 0.97, 0.99, 0.98, 0.97]
    assert len(fig.ours.values) == 9 and len(fig.baseline.values) == 9 and not fig.straddles
    assert info.samples == [1.0] * 3  # every figure of a rerun runner is pooled
    text = report.write([fig], tmp_path, quick=False, elapsed=1.0, busy_at_start=9.5)
    assert "BUSY at the start: load average 9.50" in text
    quiet = report.write([fig], tmp_path, quick=False, elapsed=1.0)
    assert "quiet at the start" in quiet and "BUSY" not in quiet
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["straddles"] is False


def _straddling(name: str, samples: list) -> Result:
    return Result(name, f"{name} figure", ">=", 0.8, samples=list(samples),
                  ours=Series("o", "x", list(samples)), baseline=Series("b", "x", [1.0] * 3))


def test_two_benchmarks_with_extra_rounds_do_not_collide(tmp_path):
    """Each benchmark works in its own scratch folder, its extra rounds inside it: two
    benchmarks that both want another round both get it (it used to be one shared
    workdir/round-1, and the second died with FileExistsError)."""
    from bench.measure import BenchContext

    seen = []

    def runner(ctx, chosen):
        seen.append(ctx.workdir)
        (ctx.workdir / "run-0").mkdir()  # as a real benchmark makes its runs: once per folder
        first = not ctx.workdir.name.startswith("round-")
        return [_straddling(chosen[0], [0.7, 0.9, 0.85] if first else [0.95, 0.96, 0.97])]

    ctx = BenchContext(quick=False, workdir=tmp_path, root=tmp_path, python=sys.executable,
                       repeats=3)
    results, spent = run.run_all(ctx, [(("a",), runner), (("b",), runner)], ["a", "b"], rounds=1)
    assert [r.verdict for r in results] == ["pass", "pass"]
    assert all(len(r.samples) == 6 and len(r.ours.values) == 6 for r in results)
    assert seen == [tmp_path / "a", tmp_path / "a" / "round-1",
                    tmp_path / "b", tmp_path / "b" / "round-1"]
    assert set(spent) == {"a", "b"}


def test_a_failing_benchmark_is_reported_and_the_others_keep_their_figures(tmp_path):
    """A benchmark that raises (even after wiping its own scratch folder) is a "failed: why"
    row in results.md and makes the exit code 1; the benchmarks before and after it keep
    their figures and their files."""
    import shutil

    from bench.measure import BenchContext

    def good(ctx, chosen):
        (ctx.workdir / "figure.txt").write_text("kept")
        return [Result(chosen[0], f"{chosen[0]} figure", ">=", 0.8, samples=[0.9, 0.95, 1.0])]

    def broken(ctx, chosen):
        shutil.rmtree(ctx.workdir)
        raise FileExistsError("round-1 already there")

    ctx = BenchContext(quick=False, workdir=tmp_path / "w", root=tmp_path,
                       python=sys.executable, repeats=3)
    results, _ = run.run_all(ctx, [(("a",), good), (("b", "b2"), broken), (("c",), good)],
                             ["a", "b", "b2", "c"], rounds=2)
    assert [(r.bench, r.verdict) for r in results] == [
        ("a", "pass"), ("b", "failed"), ("b2", "failed"), ("c", "pass")]
    assert (tmp_path / "w" / "a" / "figure.txt").read_text() == "kept"
    assert (tmp_path / "w" / "c" / "figure.txt").read_text() == "kept"
    md = report.write(results, tmp_path / "out", quick=False, elapsed=1.0)
    assert "| b | info | failed: FileExistsError: round-1 already there |" in md
    assert "| a figure | >= 0.8 | 0.950 [0.900 - 1.000] (n=3) |" in md
    assert "| c figure |" in md and md.count("**failed**") == 2


def test_an_extra_round_that_fails_keeps_the_first_rounds_figures(tmp_path):
    from bench.measure import BenchContext

    def runner(ctx, chosen):
        if ctx.workdir.name.startswith("round-"):
            raise RuntimeError("disk full")
        return [_straddling("x", [0.7, 0.9, 0.85])]

    ctx = BenchContext(quick=False, workdir=tmp_path, root=tmp_path, python=sys.executable,
                       repeats=3)
    (fig,) = run.run_with_rounds(ctx, runner, ["x"], rounds=2)
    assert fig.samples == [0.7, 0.9, 0.85] and fig.verdict == "pass"
    assert "extra round 1 failed: RuntimeError: disk full" in fig.note


def test_the_budget_trades_repeats_and_rounds_for_time(tmp_path):
    from bench import budget
    from bench.measure import BenchContext

    keys = [group[0] for group, _ in run.RUNNERS if group[0] in run.DEFAULT]
    assert set(keys) <= set(budget.COSTS)  # every benchmark has an estimate
    full = budget.choose_repeats(keys, budget.DEFAULT_BUDGET_MIN * 60)
    assert full == budget.MAX_REPEATS
    assert budget.estimate(keys, full) <= budget.DEFAULT_BUDGET_MIN * 60
    assert budget.choose_repeats(keys, 20 * 60) < full
    assert budget.choose_repeats(keys, 60) == budget.MIN_REPEATS  # never fewer than 3
    assert run.parse_args(["--budget", "20"]).budget == 20.0
    with pytest.raises(SystemExit):
        run.parse_args(["--budget", "0"])
    # a machine running twice as slow as the estimates leaves no time for an extra round
    spent = {"overhead": 2 * budget.cost("overhead", 5)}
    assert budget.slowdown(spent, 5) == pytest.approx(2.0)
    assert not budget.round_fits("overhead", ["cli"], 5, spent["overhead"], spent, 600)
    assert budget.round_fits("overhead", ["cli"], 5, 10.0, {}, 3600)
    # a round that took 50 min (its estimate: 4.4) is not run again in the hour's last 10
    assert budget.round_fits("overhead", [], 5, 3010.0, {}, 3600)
    assert not budget.round_fits("overhead", [], 5, 3010.0, {}, 3600, last_round_s=3000)
    calls = []

    def runner(ctx, chosen):
        calls.append(1)
        return [_straddling("x", [0.7, 0.9, 0.85])]

    ctx = BenchContext(quick=False, workdir=tmp_path, root=tmp_path, python=sys.executable,
                       repeats=3)
    (fig,) = run.run_with_rounds(ctx, runner, ["x"], rounds=2,
                                 more_fits=lambda last_round_s: False)
    assert len(calls) == 1 and fig.straddles


def test_a_floor_judges_the_low_end_of_the_interval_as_well():
    """Issue 27's form of target: the median at the target and its 90 % interval from the
    floor up; a low end below the floor misses and asks for more rounds."""
    steady = [0.98, 0.99, 0.97, 0.98, 0.99, 0.98, 0.97]
    assert Result("x", "a", ">=", 0.97, floor=0.95, samples=steady).verdict == "pass"
    wide = [0.90, 0.99, 0.98, 0.99, 0.98, 0.91, 0.99]  # median 0.98, interval from 0.90
    r = Result("x", "b", ">=", 0.97, floor=0.95, samples=wide)
    assert r.verdict == "miss" and r.straddles
    assert Result("x", "c", ">=", 0.97, floor=0.95, samples=[0.99, 0.98]).verdict == "pass"
    assert r.target_text() == ">= 0.97, 90 % interval >= 0.95"
