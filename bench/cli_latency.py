"""CLI latency: `enn-submit --help` and `enn-submit render CONFIG ...` in a fresh interpreter.

The target is absolute (< 0.5 s median wall time); the same-run baseline is `python -c
pass`, reported as a ratio. A separate, untimed run of each command records which heavy
modules it imported: torch must not be among them.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .measure import BenchContext, Result, Series, ratios, timed

HEAVY = ("torch", "numpy", "submitit", "fsspec", "yaml", "jinja2")
RENDER_FLAGS = ["--nodes", "2", "--gpus-per-node", "2", "--cluster", "slurm", "--container", "none"]

# Run the CLI as `enn-submit` does, then report the top-level modules it imported.
_PROBE = """
import json, runpy, sys
sys.argv = ["enn-submit"] + json.loads(sys.argv[1])
try:
    runpy.run_module("enn_cluster.client.cli", run_name="__main__")
except SystemExit:
    pass
sys.stderr.write("\\nENN-MODULES " + json.dumps(sorted({m.split('.')[0] for m in sys.modules})) + "\\n")
"""


def _command(ctx: BenchContext) -> tuple[list[str], str]:
    """The installed console script when there is one next to the interpreter."""
    script = Path(ctx.python).parent / "enn-submit"
    if script.exists():
        return [str(script)], "enn-submit (console script)"
    return [ctx.python, "-m", "enn_cluster.client.cli"], "python -m enn_cluster.client.cli"


def _config(ctx: BenchContext) -> Path:
    path = ctx.workdir / "cli" / "run.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text((ctx.root / "examples" / "demo.yaml").read_text())
    return path


def _run(cmd: list[str], ctx: BenchContext, cwd: Path) -> float:
    def call() -> None:
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd,
                             env=ctx.subprocess_env(), timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-500:]}")
    return timed(call)


def imported_heavy(ctx: BenchContext, argv: list[str], cwd: Path) -> list[str]:
    res = subprocess.run([ctx.python, "-c", _PROBE, json.dumps(argv)], capture_output=True,
                         text=True, cwd=cwd, env=ctx.subprocess_env(), timeout=60)
    line = [x for x in res.stderr.splitlines() if x.startswith("ENN-MODULES ")]
    if not line:
        raise RuntimeError(f"import probe failed: {res.stderr[-500:]}")
    mods = set(json.loads(line[-1].split(" ", 1)[1]))
    return [m for m in HEAVY if m in mods]


def run(ctx: BenchContext) -> list[Result]:
    cfg = _config(ctx)
    cwd = cfg.parent
    base_cmd, how = _command(ctx)
    cases = {"--help": ["--help"], "render": ["render", str(cfg), *RENDER_FLAGS]}
    repeats = max(ctx.repeats, 3) if ctx.quick else ctx.repeats + 2
    ctx.log(f"cli: {how}, {repeats} repeats")
    for argv in cases.values():  # warm the file system cache and .pyc files once
        _run(base_cmd + argv, ctx, cwd)
    pass_s: list[float] = []
    times: dict = {k: [] for k in cases}
    for _ in range(repeats):
        pass_s.append(_run([ctx.python, "-c", "pass"], ctx, cwd))
        for key, argv in cases.items():
            times[key].append(_run(base_cmd + argv, ctx, cwd))
    results = []
    for key, argv in cases.items():
        heavy = imported_heavy(ctx, argv, cwd)
        torch_note = ("torch IMPORTED (should not be)" if "torch" in heavy
                      else "torch not imported")
        ratio = sorted(ratios(times[key], pass_s))[len(pass_s) // 2]
        results.append(Result(
            "cli", f"CLI latency: enn-submit {key}", "<", 0.5, unit="s", samples=times[key],
            ours=Series(f"{how} {' '.join(argv[:1])}", "s", times[key]),
            baseline=Series("python -c pass", "s", pass_s),
            note=(f"{ratio:.1f}x python -c pass (median of per-repeat ratios); {torch_note}; "
                  f"heavy modules imported: {', '.join(heavy) or 'none'}")))
        if "torch" in heavy:
            results[-1].check_failed = "torch imported"
    return results
