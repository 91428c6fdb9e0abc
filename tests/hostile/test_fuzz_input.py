"""Fuzzed bad input: configs, `--set`, site files, job specs and CLI flags with wrong types,
unknown keys, huge, negative or non-finite numbers, unicode and shell metacharacters
(spaces, commas, colons, quotes, `$()`, backticks, newlines).

The contract (README, "Bad input"): every input either works, with each value quoted where
it reaches a shell, or ends with exit code 2 and ONE line naming the field, no traceback,
and nothing written. Two levels: many examples of the pure functions in this process, and
a bounded number of real `enn-submit` processes for what must be refused before torch is
imported (a fake `torch` package on PYTHONPATH makes any import of it exit 97).
"""
from __future__ import annotations

import math
import os
import subprocess

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from enn_cluster.cluster import job_script
from enn_cluster.cluster import site
from enn_cluster.config.loading import apply_overrides, config_from_dict, dump_config, load_config
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.yaml_file import read_yaml
from enn_cluster.errors import UserError
from enn_cluster.cluster.job_spec import JobSpec
from fuzz_support import (ANY, CONFIGS, FAST, HOSTILE, NUMBERS, SHELL, mostly, one_line_error,
                          shellcheck)

# -- in-process: config parsing and validation ----------------------------------------------


@FAST
@given(data=CONFIGS)
def test_any_config_validates_or_names_the_field(data):
    """Accepted configs freeze to YAML and read back the same; refused ones name a field."""
    try:
        cfg = config_from_dict(data)
    except UserError as exc:
        one_line_error(as_printed(str(exc)))
        assert ":" in str(exc), str(exc)
        event("refused: " + str(exc).split(":")[0].split("[")[0])
        return
    event("accepted")
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg
    for value in (cfg.training.lr, cfg.parallel.timeout_s, cfg.model.dropout):
        assert math.isfinite(value)


def as_printed(message: str) -> str:
    """What the CLI prints: cli.one_line escapes a newline from a raw path or value."""
    from enn_cluster.client.cli import one_line

    return one_line(message)


OVERRIDE_KEYS = st.sampled_from(["training.lr", "training.epochs", "training.seed", "run_name",
                                 "runs_root", "model.hidden_sizes", "model.kwargs.x",
                                 "parallel.timeout_s", "data.synthetic.n_samples", "training",
                                 "training.lr.x", "nope", "data.synthetic.seed", ".a", "a..b",
                                 "model.name", "training.bf16"]) | HOSTILE
OVERRIDE_VALUES = HOSTILE | st.sampled_from(
    ["1e-4", "1e400", "-1", ".nan", ".inf", "[1, 2]", "{a: 1}", "&a [*a]",
     "!!python/name:os.system", "2024-13-45", "9" * 5000, "!!float x", "[unclosed", "'quoted'", "null", "~", "true", "0x10",
     "1_000", "- a\n- b", "*undefined"])


@FAST
@given(overrides=st.lists(st.tuples(OVERRIDE_KEYS, st.sampled_from("=") | HOSTILE,
                                    OVERRIDE_VALUES).map("".join), max_size=4),
       base=st.sampled_from([{}, {"run_name": "r", "training": {"epochs": 2}}]))
def test_any_set_override_applies_or_names_the_field(overrides, base):
    try:
        cfg = config_from_dict(apply_overrides(base, overrides))
    except UserError as exc:
        one_line_error(as_printed(str(exc)))
        return
    assert isinstance(cfg, RunConfig)


@FAST
@given(body=st.binary(max_size=60) | HOSTILE.map(str.encode) | st.sampled_from([
    b"a: &a [*a]\n", b"training: [unclosed\n", b"\xff\xfe\x00x", b"- 1\n- 2\n", b"42\n",
    b"run_name: 2024-13-45\n", b"training: {seed: " + b"9" * 5000 + b"}\n",
    b"a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\n"
    b"e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"]))
def test_any_config_file_loads_or_names_the_file(tmp_path_factory, body):
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_bytes(body)
    try:
        load_config(str(path))
    except UserError as exc:
        one_line_error(as_printed(str(exc)))


def test_unreadable_config_files(tmp_path):
    for path, needle in ((tmp_path, "is a directory"), (tmp_path / "nope.yaml", "does not exist")):
        with pytest.raises(UserError, match=needle):
            read_yaml(str(path))
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.yaml"
        locked.write_text("a: 1\n")
        locked.chmod(0)
        with pytest.raises(UserError, match="cannot read"):
            read_yaml(str(locked))


# -- in-process: site files, merge and rendering ----------------------------------------------

ONE_LINE = HOSTILE.filter(lambda t: "\n" not in t and "\r" not in t)
SITE_VALID = {
    "partition": st.sampled_from(["gpu", "a100,h100"]), "account": st.just("ml"),
    "qos": st.just("high"),
    "mounts": st.lists(st.sampled_from(["/data:/data:ro", "/a:/b", "/s:/s:ro+rprivate"]),
                       max_size=2),
    "runs_root": st.just("/shared/runs"), "image_cache": st.just("/shared/images"),
    "image": st.sampled_from(["none", "/i/enn.sqsh", "nvcr.io#nvidia/pytorch:24.05-py3"]),
    "nccl_profile": st.sampled_from(["auto", "ib", "efa"]), "gpus_per_node": st.integers(0, 8),
    "signal_grace_s": st.integers(1, 300),
    "extra_sbatch_args": st.lists(st.sampled_from(["--constraint=a100", "--comment=x"]),
                                  max_size=2),
    "extra_srun_args": st.lists(st.sampled_from(["--cpu-bind=none", "--label"]), max_size=2),
    "python": st.sampled_from(["python3", "/opt/venv/bin/python"]),
    "time": st.sampled_from([60, "04:00:00", "1-00:00:00"]),
    "setup_lines": st.lists(st.sampled_from(["module load nccl", "export A=1"]), max_size=2),
}
# One key at a time gets a hostile value; some still pass (quoted), most are refused.
# Not setup_lines: they are shell the admin writes, run as written by design.
SITE_HOSTILE = st.sampled_from(sorted(set(SITE_VALID) - {"setup_lines"})).flatmap(
    lambda key: st.one_of(
        HOSTILE, NUMBERS, ANY, st.lists(HOSTILE, min_size=1, max_size=2),
        st.lists(ONE_LINE.map(lambda t: "--comment=" + t), min_size=1, max_size=2),
        ONE_LINE.map(lambda t: "/opt/py " + t)).map(lambda value: {key: value}))


def _site_dicts():
    valid = st.fixed_dictionaries({}, optional=SITE_VALID)
    return st.one_of(
        st.tuples(valid, mostly(SITE_HOSTILE, st.just({}))).map(lambda p: {**p[0], **p[1]}),
        ANY, st.tuples(valid, st.dictionaries(HOSTILE, ANY, min_size=1, max_size=1))
        .map(lambda p: {**p[0], **p[1]}))


@SHELL
@given(data=_site_dicts(), job_name=st.none() | HOSTILE, task=st.sampled_from(["train", "predict"]))
def test_any_site_file_merges_and_renders_or_names_the_key(tmp_path_factory, data, job_name, task):
    """parse_site -> merge with flags -> JobSpec -> script: each step accepts or refuses
    with a UserError; what renders passes bash -n and shellcheck."""
    try:
        conf = site.parse_site(data, "/etc/enn_cluster/site.yaml")
    except UserError as exc:
        one_line_error(as_printed(str(exc)))
        assert str(exc).startswith("site"), str(exc)
        event("refused by parse_site")
        return
    opts = site.merge(site.DEFAULTS, conf, {"partition": None, "time": None})
    try:
        spec = JobSpec(job_name=job_name or "enn-r", run_dir="/shared/runs/r", task=task,
                       predict_name="p1" if task == "predict" else None,
                       time=opts["time"], partition=opts["partition"], account=opts["account"],
                       qos=opts["qos"], signal_grace_s=opts["signal_grace_s"],
                       container_image=None if opts["image"] in (None, "none") else opts["image"],
                       container_mounts=() if opts["image"] in (None, "none") else opts["mounts"],
                       nccl_profile=opts["nccl_profile"], python=opts["python"],
                       extra_sbatch_args=opts["extra_sbatch_args"],
                       extra_srun_args=opts["extra_srun_args"], setup_lines=opts["setup_lines"])
    except UserError as exc:
        one_line_error(as_printed(str(exc)))
        event("refused by JobSpec")
        return
    event("rendered")
    shellcheck(job_script.render_batch_script(spec), tmp_path_factory.mktemp("sc"))


SRUN_STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_OUT/argv"
env -0 > "$STUB_OUT/env"
"""


@SHELL
@given(job_name=mostly(st.sampled_from(["enn-r", "träning.v1+2"])),
       run_name=mostly(st.sampled_from(["r1", "träning-λ"])),
       env=st.dictionaries(st.sampled_from(["ENN_NOTE", "HF_HOME", "X"]), HOSTILE, max_size=3),
       mount=mostly(st.just("/data:/data:ro")),
       python=ONE_LINE.map(lambda t: "/opt/py " + t), comment=ONE_LINE)
def test_hostile_spec_values_are_refused_or_reach_srun_verbatim(
        tmp_path_factory, job_name, run_name, env, mount, python, comment):
    """Job names, run directories and mounts either pass the strict checks (#SBATCH and
    Pyxis cannot carry metacharacters) or are refused; env values, the interpreter and
    srun arguments are quoted: run under bash with a stub srun, they arrive byte-for-byte
    and nothing in them executes."""
    tmp = tmp_path_factory.mktemp("spec")
    run_dir = tmp / "runs" / (run_name.replace("/", "_") or "r")  # stays inside tmp
    image = tmp / "enn.sqsh"
    image.write_bytes(b"hsqs")
    try:
        spec = JobSpec(job_name=job_name, run_dir=str(run_dir), env=env, python=python,
                       container_image=str(image), container_mounts=(mount,),
                       extra_srun_args=(f"--comment={comment}",), nccl_profile="none",
                       gpus_per_node=0, procs_per_node=2)
    except UserError as exc:
        one_line_error(as_printed(str(exc)))
        event("refused: " + str(exc).split(":")[0])
        return
    event("rendered and run")
    script = job_script.render_batch_script(spec)
    shellcheck(script, tmp)
    bin_dir, cwd = tmp / "bin", tmp / "cwd"
    for d in (bin_dir, cwd, run_dir):
        d.mkdir(parents=True, exist_ok=True)
    (bin_dir / "srun").write_text(SRUN_STUB)
    (bin_dir / "srun").chmod(0o755)
    (tmp / "job.sbatch").write_text(script)
    done = subprocess.run(["bash", str(tmp / "job.sbatch")], cwd=cwd, capture_output=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7",
                               "SLURM_JOB_NODELIST": "n1", "STUB_OUT": str(tmp),
                               "HOME": str(tmp)}, timeout=30)
    assert not [p.name for p in cwd.iterdir()], "a hostile string executed"
    assert done.returncode == 0, done.stderr
    argv = (tmp / "argv").read_bytes().decode().split("\0")[:-1]
    assert f"--comment={comment}" in argv and argv[argv.index("-m") - 1] == python
    seen = dict(item.split("=", 1) for item in
                (tmp / "env").read_bytes().decode().split("\0")[:-1] if "=" in item)
    for name, value in env.items():
        assert seen[name] == value
