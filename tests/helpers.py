"""Helpers shared by tests: run the real CLI in a subprocess, read checkpoints back."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from cli_zygote import run_cli

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the support modules and data/, golden/; the tests sit in folders below


def cli_env(extra: dict | None = None) -> dict:
    """The environment `cli` runs `enn-submit` in: ours, this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def fresh_cli(argv: list[str], env: dict, cwd, timeout=300) -> subprocess.CompletedProcess:
    """`enn-submit ARGV` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def cli(*args, timeout=300, env=None, cwd=None) -> subprocess.CompletedProcess:
    """`enn-submit ARGS` as a user runs it: its own process, forked from an interpreter that
    has imported the CLI's modules where the environment allows (tests/cli_zygote.py),
    else a fresh interpreter."""
    full_env = cli_env(env)
    argv = [str(a) for a in args]
    where = str(cwd or ROOT)
    forked = run_cli(argv, full_env, where, timeout)
    return forked if forked is not None else fresh_cli(argv, full_env, where, timeout)


def refused(res: subprocess.CompletedProcess, *words: str) -> str:
    """A command refused its input as the brief says: exit 2, no traceback, one line on
    stderr holding every one of `words`. Returns that line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.stderr[-3000:]
    return lines[0]


def full_state(state: dict) -> dict:
    """A (nested) state dict as flat name -> whole tensor: DTensors gathered (a collective:
    every rank calls it), copies that a later load cannot change."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in full_state(value).items()})
        elif hasattr(value, "clone"):
            out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def write_config(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path


def faults(**steps: int) -> dict:
    """The environment that injects test faults in the workers (worker/fault_injection.py),
    e.g. faults(fail_at_step=13, fail_rank=3): pass it as a launch's env."""
    return {"ENN_TEST_FAULTS": ",".join(f"{k}={v}" for k, v in steps.items())}


def small_config(tmp_path: Path, name: str = "run", **over) -> dict:
    cfg = {
        "run_name": name, "runs_root": str(tmp_path / "runs"),
        "model": {"name": "mlp", "hidden_sizes": [16, 16]},
        "data": {"synthetic": {"n_samples": 512, "n_features": 8}, "eval_fraction": 0.125},
        "training": {"epochs": 3, "per_device_train_batch_size": 8, "lr": 3e-3,
                     "warmup_ratio": 0.1, "seed": 7},
        "checkpoint": {"every_steps": 8, "keep_last": 5},
        "parallel": {"nodes": 2, "procs_per_node": 2},
    }
    return with_sections(cfg, over)


def with_sections(cfg: dict, over: dict) -> dict:
    """`cfg` with each section of `over` merged into its own (a plain value replaces)."""
    for key, value in over.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.update({key: value})
    return cfg


def full_params(step_dir: Path) -> dict:
    """A DCP checkpoint's full model weights in this process (no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent.parent / f".full-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=True)
    out.unlink()
    return state["model"]


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The records of metrics.jsonl; what follows its last newline is a write in flight
    (a reader polling a running job can see part of a line), not a record yet."""
    lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    recs = [json.loads(line) for line in lines if line.strip()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def assert_same_steps(run, reference, final: int) -> None:
    """Steps 1..final in both, each with the same LR (exact) and epoch, and losses within
    float tolerance; the newest attempt's record of a step wins (steps redone)."""
    def per_step(path) -> dict:
        return {r["step"]: r for r in metrics(path, "train")}

    ours, theirs = per_step(run), per_step(reference)
    assert sorted(ours) == sorted(theirs) == list(range(1, final + 1))
    for step in theirs:
        assert ours[step]["lr"] == theirs[step]["lr"], step  # exact: a pure function of the step
        assert ours[step]["epoch"] == theirs[step]["epoch"], step
        # float tolerance: the gradient sums round differently at another world size, and
        # AdamW's m / sqrt(v) turns that noise into full-size updates where v is near 0
        assert math.isclose(ours[step]["loss"], theirs[step]["loss"], rel_tol=1e-2, abs_tol=1e-5), \
            (step, ours[step]["loss"], theirs[step]["loss"])


def assert_same_run(run, reference, resumed_at_world: int, final: int = 42) -> None:
    """`run` was stopped and resumed at `resumed_at_world` ranks; `reference` ran through
    (small_config: 3 epochs of 448 rows in global batches of 32 = 42 steps). Same steps,
    exact LR, same epochs, losses and final weights within float tolerance."""
    assert_same_steps(run, reference, final)
    assert [r["epoch"] for r in metrics(run, "eval")][-3:] == [0, 1, 2]
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["world_size"], resume["global_batch"]) == (8, resumed_at_world, 32)
    assert metrics(run, "start")[-1]["total_steps"] == final
    mine, base = full_params(run / "checkpoints" / f"step-{final}"), \
        full_params(reference / "checkpoints" / f"step-{final}")
    for key in base:
        assert (mine[key] - base[key]).norm() <= 1e-2 * base[key].norm(), key


def train_tiny(tmp: Path, name: str) -> Path:
    """A run trained for 2 steps on 1 process with a checkpoint at step 2: its path."""
    cfg = small_config(tmp, name, training={"max_steps": 2}, checkpoint={"every_steps": 2},
                       parallel={"nodes": 1, "procs_per_node": 1})
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    done = cli("train", "--config", tmp / f"{name}.yaml", cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "runs" / name


def wait_train_step(run: Path, step: int, timeout: float = 90) -> None:
    """Poll the run's metrics until a train record reaches `step` (bounded)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in metrics(run, "train")):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{run}: no train step {step} within {timeout} s")


def wait_for_file(path: Path, timeout: float) -> None:
    """Poll until `path` exists (bounded)."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.3)


def in_pid_namespace(code: str, *args, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run Python `code` as pid 1 of a PID namespace of its own: a test that signals a pid
    read from a file does it there, so that a wrong pid can never reach this machine's
    processes (and everything left over dies with the namespace)."""
    import shutil

    import pytest

    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot isolate a test that sends signals")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                           sys.executable, "-c", code, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


SOCKET_FALLBACK_LOG = [  # NCCL's init log where the EFA plugin is absent: it falls back to TCP
    "ip-10-1-2-3:77:77 [0] NCCL INFO NCCL version 2.23.4+cuda12.6",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/IB : No device found.",
    "ip-10-1-2-3:77:90 [0] NCCL INFO NET/Socket : Using [0]ens32:10.1.2.3<0>",
    "ip-10-1-2-3:77:90 [0] NCCL INFO Using network Socket",
]


def as_gpu_ranks_on_sockets(run: Path, site_profile: str = "efa") -> None:
    """The GPU fault on this CPU machine: the newest attempt's backend reports become what
    its ranks write on GPUs when the site's profile is `site_profile` and NCCL fell back to
    sockets. NCCL's init log goes where the worker points NCCL_DEBUG_FILE; the NCCL fields
    come from the product's fabric_fields over that log, the file from its write_report.
    Only the device and lane names are set by hand (there is no GPU here to read them)."""
    from enn_cluster.config.nccl import PROFILE_VAR
    from enn_cluster.storage import backend_report as br
    from enn_cluster.storage.attempts import attempt_dirs
    from enn_cluster.storage.rundir import RunDir

    attempt, reports = br.newest_reports(attempt_dirs(RunDir(run)))
    log_dir = run / "logs" / attempt
    for rep in reports:
        nccl_log = log_dir / br.NCCL_LOG_NAME.format(rank=rep["rank"])
        nccl_log.write_text("\n".join(SOCKET_FALLBACK_LOG) + "\n")
        rep.update(device=f"cuda:{rep['rank']}", device_type="cuda", device_name="NVIDIA H100",
                   lanes={"accelerator": "cpu:gloo,cuda:nccl", "control": "gloo",
                          "checkpoint": "gloo"},
                   nccl_profile=site_profile,
                   **br.fabric_fields({PROFILE_VAR: site_profile}, nccl_log, "2.23.4"))
        br.write_report(log_dir, rep)


def controller_up_scontrol(bin_dir: Path) -> None:
    """An scontrol in `bin_dir` whose `ping` says the controller is up (the words of a real
    one, tests/data/slurm/ping_up.txt) and that knows nothing else: a spy sbatch beside it
    is reached past submit's check that Slurm answers here."""
    stub = bin_dir / "scontrol"
    up = (Path(__file__).parent / "data" / "slurm" / "ping_up.txt").read_text().splitlines()[0]
    stub.write_text(f'#!/bin/sh\n[ "$1" = ping ] && echo "{up}" && exit 0\n'
                    'echo "scontrol: error: unexpected" >&2\nexit 1\n')
    stub.chmod(0o755)


def slurm_answers_here(tmp_path: Path, monkeypatch) -> None:
    """An sbatch that submits nothing and an scontrol whose ping says up, first on PATH: the
    API and the CLI check that Slurm answers here before they plan a job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def outside_layout(run: Path) -> list[str]:
    """Paths of a run directory that storage/layout.py's table does not list (a file
    nobody documented is a file nobody cleans up, locks or explains)."""
    import fnmatch

    from enn_cluster.storage import layout

    def pattern(name: str) -> str:  # <job>, <name>, <ns>, N stand for one path part
        return re.sub(r"<[a-z]+>|\bN\b", "*", name.rstrip("/"))

    files, folders = set(), set()
    tops = {entry.name.split("/")[0] for entry in layout.LAYOUT}  # requeue/, checkpoints/
    for entry in layout.LAYOUT:
        (folders if entry.name.endswith("/") else files).add(pattern(entry.name))
    bad = []
    for path in sorted(run.rglob("*")):
        rel = path.relative_to(run).as_posix()
        if rel not in tops and not any(fnmatch.fnmatchcase(rel, f) for f in files) and not any(
                fnmatch.fnmatchcase(rel, f) or fnmatch.fnmatchcase(rel, f + "/*")
                for f in folders):
            bad.append(rel)
    return bad
