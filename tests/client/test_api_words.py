"""The API's errors in the API's words (client/api_words.py): a UserError about an input
(config/inputs.py) leaves an API function naming the API's argument or `cluster=` key, and
the CLI given the same bad input names its flag. Real API calls and real `enn-submit`
processes; Slurm is an sbatch that refuses and an scontrol whose ping says up."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import event, given

import enn_cluster
from enn_cluster.config.inputs import INPUTS
from enn_cluster.config.launch_options import OPTIONS
from enn_cluster.errors import UserError
from fuzz_support import PROCS, RENDER_FLAGS
from helpers import cli, slurm_answers_here, small_config, train_tiny

# a CLI input's name in a line: a flag (--nodes) or RUN_DIR, not part of a longer word
_CLI_NAME = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|RUN_DIR)(?![\w-])")
_BY_FLAG = {o.flag: o.api for o in OPTIONS if o.flag and o.api}


def cli_names_in(message: str) -> list[str]:
    """The CLI's names of inputs the API takes (it has a word for them) found in `message`;
    a command quoted for the shell ('enn-submit ...') is the CLI's own and not looked in."""
    outside_commands = re.sub(r"'enn-submit [^']*'", "", message)
    api_takes = {i.cli for i in INPUTS.values() if i.api}
    return [n for n in _CLI_NAME.findall(outside_commands) if n in api_takes]


def api_error(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    return str(caught.value)


@pytest.fixture
def slurm_here(tmp_path, monkeypatch):
    """Slurm answers here (and refuses every job); the site file names an image; cwd is a
    folder of this test's own."""
    slurm_answers_here(tmp_path, monkeypatch)
    site = tmp_path / "site.yaml"
    site.write_text("image: /img/base.sqsh\n")
    monkeypatch.setenv("ENN_SITE_CONFIG", str(site))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _data():
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    return x, x[:, :1] ** 2


def _train(tmp_path: Path, cluster=None, config=None):
    x, y = _data()
    config = {**(config or {}), "training": {**(config or {}).get("training", {}),
                                             "max_steps": 1}}
    return enn_cluster.train("api_models:tiny", x, y, run_dir=str(tmp_path / "runs" / "r"),
                             cluster=cluster, config=config)


@pytest.mark.parametrize("key, value, api_says, cli_says", [
    ("nodes", "two", "cluster[\"nodes\"]: 'two' is not a node count",
     "--nodes: 'two' is not a node count"),
    ("gpus_per_node", -1, 'cluster["gpus_per_node"]: -1 must be >= 0',
     "--gpus-per-node: -1 must be >= 0"),
    ("partition", "gpu;rm", 'cluster["partition"]: ', "--partition: "),
    ("time", "1h", "cluster[\"time\"]: '1h' is not a time", "--time: '1h' is not a time"),
    ("container", "docker://x", 'cluster["container"]: ', "--container-image: "),
], ids=["nodes", "gpus_per_node", "partition", "time", "container"])
def test_a_bad_launch_option_is_named_by_its_key_and_by_its_flag(
        slurm_here, key, value, api_says, cli_says):
    """The same bad value through `cluster=` and through the flag: each front end's line
    names it in its own words, the API's with no flag in it."""
    tmp_path = slurm_here
    said = api_error(lambda: _train(tmp_path, {key: value}))
    assert said.startswith(api_says), said
    assert cli_names_in(said) == [], said
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(small_config(tmp_path, "c")))
    flag = next(o.flag for o in OPTIONS if o.name == key)
    res = cli("train", "--config", cfg, "--cluster", "slurm", flag, str(value), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith(f"enn-submit: error: {cli_says}") \
        or f": {cli_says}" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_bad_run_directory_is_the_argument_each_api_function_takes(tmp_path):
    """RUN_DIR on the command line; `run_or_dir` to predict and export, `Run.open(path)`."""
    missing = tmp_path / "missing"
    x = np.zeros((3, 8), np.float32)
    lines = [api_error(lambda: enn_cluster.predict(missing, x)),
             api_error(lambda: enn_cluster.export(missing, tmp_path / "art")),
             api_error(lambda: enn_cluster.Run.open(missing))]
    assert lines[0].startswith(f"run_or_dir: {missing} is not a run directory"), lines[0]
    assert lines[1].startswith(f"run_or_dir: {missing} is not a run directory"), lines[1]
    assert lines[2].startswith(f"Run.open(path): {missing} is not a run directory"), lines[2]
    assert all(cli_names_in(line) == [] for line in lines), lines
    assert all(line.endswith("made by train() or enn-submit") for line in lines), lines
    np.save(tmp_path / "x.npy", x)
    res = cli("predict", missing, "--input", tmp_path / "x.npy", cwd=tmp_path)
    assert res.returncode == 2 and f"RUN_DIR: {missing} is not a run directory" in res.stderr \
        and "enn-submit train or prepare" in res.stderr, res.stderr


@PROCS
@given(flags=RENDER_FLAGS)
def test_the_cli_fuzz_flags_given_to_the_api_are_refused_in_its_words(slurm_here, flags):
    """The CLI fuzz's hostile launch flags (tests/hostile/test_fuzz_cli.py) as the API's
    `cluster=` keys and the config's keys: whatever is refused names no CLI flag."""
    tmp_path = slurm_here
    cluster, over = {}, {}
    for flag, value in zip(flags[0::2], flags[1::2]):
        if flag == "--set":
            key, _, text = value.partition("=")
            section, _, rest = key.partition(".")
            if rest:
                over.setdefault(section, {})[rest] = text
            else:
                over[section] = text
        elif flag == "--mount":
            cluster.setdefault("mounts", []).append(value)
        elif flag in _BY_FLAG:
            cluster[_BY_FLAG[flag]] = value
    try:
        _train(tmp_path / "t", cluster, over)
    except UserError as exc:
        event("refused")
        assert cli_names_in(str(exc)) == [], str(exc)


@pytest.mark.slow
def test_a_trained_run_refuses_a_bad_step_name_out_and_format_in_each_front_ends_words(
        tmp_path):
    """The same bad step, input, format and output directory through the API and through
    `enn-submit`: the API's lines name its arguments and no flag, the CLI's the flags."""
    run = train_tiny(tmp_path, "t")
    x, wide = np.zeros((3, 8), np.float32), np.zeros((3, 5), np.float32)
    (tmp_path / "art").mkdir()
    np.save(tmp_path / "wide.npy", wide)
    np.save(tmp_path / "x.npy", x)
    cases = [  # (API call, its line's start, enn-submit argv, its line's part)
        (lambda: enn_cluster.predict(run, x, step=7),
         "step: step-7 is not a complete checkpoint", ["predict", run, "--input",
                                                       tmp_path / "x.npy", "--step", "7"],
         "--step: step-7 is not a complete checkpoint"),
        (lambda: enn_cluster.Run.open(run).load_model(step=7),
         "step: step-7 is not a complete checkpoint", None, None),
        (lambda: enn_cluster.predict(run, wide), "X: rows have shape (5,)",
         ["predict", run, "--input", tmp_path / "wide.npy"], "--input: rows have shape (5,)"),
        (lambda: enn_cluster.predict(run, x, name="-rf"), "name: '-rf' must be letters",
         ["predict", run, "--input", tmp_path / "x.npy", "--name=-rf"],
         "--name: '-rf' must be letters"),
        (lambda: enn_cluster.export(run, tmp_path / "o", format="onnx"),
         "format: 'onnx' is not a format", ["export", run, "--out", tmp_path / "o",
                                            "--format", "onnx"],
         "argument --format: invalid choice: 'onnx'"),
        (lambda: enn_cluster.export(run, tmp_path / "art"), f"out: {tmp_path / 'art'} exists",
         ["export", run, "--out", tmp_path / "art"], f"--out: {tmp_path / 'art'} exists"),
    ]
    for call, api_says, argv, cli_says in cases:
        said = api_error(call)
        assert said.startswith(api_says) and cli_names_in(said) == [], said
        if argv is not None:
            res = cli(*argv, cwd=tmp_path)
            assert res.returncode == 2 and cli_says in res.stderr, res.stderr
    assert not (run / "predictions").exists() or not any((run / "predictions").iterdir())
