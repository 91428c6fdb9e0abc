"""tests/cli_zygote.py, the forked `enn-submit` that helpers.cli calls: a call answers
exactly as a fresh interpreter does (exit code, stdout, stderr) in the call's cwd and
environment; a call whose environment a fresh interpreter would read while importing takes a
fresh interpreter, and its own zygote when that environment comes again."""
from __future__ import annotations

import json
import os

import pytest

import cli_zygote
from cli_zygote import import_env, run_cli
from helpers import ROOT, cli_env, fresh_cli, write_config

pytestmark = pytest.mark.skipif(os.environ.get("ENN_TEST_FRESH_CLI") == "1",
                                reason="the zygote is turned off in this session")


def _same_as_fresh(args, cwd, **extra):
    env = cli_env(extra)
    forked = run_cli(list(args), env, str(cwd), 120)
    assert forked is not None, "no zygote served this call"
    fresh = fresh_cli(list(args), env, cwd, 120)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    return forked


def test_help_a_plan_and_refusals_answer_as_a_fresh_interpreter(tmp_path):
    """Relative paths resolve in the call's cwd; a refusal is the same one line, exit 2."""
    write_config(tmp_path / "run.yaml", run_name="z", runs_root=str(tmp_path / "runs"))
    write_config(tmp_path / "bad.yaml", training={"max_steps": -1})
    assert _same_as_fresh(["--help"], tmp_path).returncode == 0
    plan = _same_as_fresh(["plan", "--config", "run.yaml", "--nodes", "1", "--json"], tmp_path)
    assert plan.returncode == 0 and '"usable_gb"' in plan.stdout, plan.stdout + plan.stderr
    for args in (["plan", "--config", "bad.yaml"], ["status", "no-such-run"]):
        res = _same_as_fresh(args, tmp_path)
        assert res.returncode == 2 and res.stderr.startswith("enn-submit: error: "), res.stderr


def test_the_calls_environment_reaches_the_command(tmp_path):
    """ENN_SITE_CONFIG is read when the command runs: the plan follows the call's site."""
    cfg = write_config(tmp_path / "run.yaml", run_name="z", runs_root=str(tmp_path / "runs"))
    site = tmp_path / "site.yaml"
    site.write_text("gpu_mem_gb: 40\n")
    args = ["plan", "--config", str(cfg), "--nodes", "1", "--json"]
    sited = json.loads(_same_as_fresh(args, tmp_path, ENN_SITE_CONFIG=str(site)).stdout)
    plain = json.loads(_same_as_fresh(args, tmp_path).stdout)
    assert sited["usable_gb"] < 40 < plain["usable_gb"], (sited, plain)


@pytest.mark.parametrize("name", ["HOME", "HF_HUB_OFFLINE", "PYTHONPATH", "OMP_NUM_THREADS"])
def test_an_environment_read_while_importing_is_fresh_then_its_own_zygotes(tmp_path, name):
    """The value is one this worker has not seen: the session's own environment may hold
    this name already (CI's did, with OMP_NUM_THREADS=1 left by a benchmark's launch)."""
    run_cli(["--help"], cli_env(), str(tmp_path), 120)
    assert run_cli(["--help"], cli_env(), str(tmp_path), 120) is not None  # the session's own
    env = next(e for e in (cli_env({name: _value(name, tmp_path, i)}) for i in range(1, 9))
               if import_env(e) not in cli_zygote._SEEN)
    assert run_cli(["--help"], env, str(tmp_path), 120) is None
    again = run_cli(["--help"], env, str(tmp_path), 120)
    assert again is not None and again.returncode == 0
    assert again.stdout == fresh_cli(["--help"], env, tmp_path, 120).stdout


def _value(name, tmp_path, i):
    if name == "PYTHONPATH":
        return f"{tmp_path / str(i)}{os.pathsep}{ROOT}"
    return str(tmp_path / str(i)) if name == "HOME" else str(i)
