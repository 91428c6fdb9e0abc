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

import dataclasses
import itertools
import math
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from enn_cluster import config_checks
from enn_cluster import job_spec, site
from enn_cluster.config import (RunConfig, apply_overrides, config_from_dict, dump_config,
                                load_config, read_yaml)
from enn_cluster.errors import UserError
from enn_cluster.job_spec import JobSpec
from helpers import ROOT, small_config

FAST = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])
SHELL = settings(FAST, max_examples=20)  # each example runs bash and shellcheck
PROCS = settings(FAST, max_examples=15)  # each example starts an enn-submit process

# Pieces of hostile text; CANARY_* files appear in the working directory if any executes.
PIECES = ("$(touch CANARY_a)", "`touch CANARY_b`", "; touch CANARY_c", "| touch CANARY_d",
          "&& touch CANARY_e", "$HOME", "${PATH}", "'", '"', "\\", "\n", "\r", "\t", " ", ",",
          ":", "=", "#", "%", "%j", "*", "?", "~", "!", "&", "<", ">", "{", "}", "[", "]",
          "..", "/", "-", "--", "ü", "λ", "✓", "名", "\u200b", "\x7f", "\x1b[31m", "-rf")
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=6)
HOSTILE = st.lists(st.sampled_from(PIECES) | _text, min_size=1, max_size=5).map("".join)
ARGV_SAFE = HOSTILE.filter(lambda t: "\x00" not in t)  # argv cannot carry NUL
NUMBERS = st.sampled_from([0, -1, 1, 2, -(2**63), 2**64, 10**30, 10**400]) | st.integers()
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1e-300, 1e300, float("inf"), float("nan")])
ANY = st.recursive(st.none() | st.booleans() | NUMBERS | FLOATS | HOSTILE,
                   lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(HOSTILE, inner, max_size=3), max_leaves=6)


def one_line_error(message: str) -> None:
    assert message and len(message.strip().splitlines()) == 1, message
    assert "Traceback" not in message and "\x1b" not in message, message


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy = HOSTILE) -> st.SearchStrategy:
    """Valid seven times in eight: enough examples get past validation to be rendered."""
    return st.sampled_from((False,) * 7 + (True,)).flatmap(
        lambda bad: hostile if bad else valid)


def _leaf(tp) -> st.SearchStrategy:
    """Values for a field of type `tp`: mostly well-typed (huge, negative, non-finite,
    hostile), sometimes anything at all."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    typed = {int: NUMBERS, float: FLOATS | NUMBERS, bool: st.booleans(), str: HOSTILE,
             list: st.lists(NUMBERS | HOSTILE, max_size=3),
             dict: st.dictionaries(HOSTILE, ANY, max_size=3)}.get(base, ANY)
    return mostly(typed, ANY)


def _section(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        fields[f.name] = _section(tp) if dataclasses.is_dataclass(tp) else _leaf(tp)
    known = st.fixed_dictionaries({}, optional=fields)
    unknown = st.dictionaries(HOSTILE | NUMBERS, ANY, max_size=1)
    return mostly(known, st.tuples(known, unknown).map(lambda p: {**p[0], **p[1]}) | ANY)


CONFIGS = _section(RunConfig)


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
    from enn_cluster.cli import one_line

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


def shellcheck(text: str, tmp: Path) -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is missing; CI must install it (apt-get install -y shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    path = tmp / "job.sbatch"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, text
    done = subprocess.run([exe, "-s", "bash", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


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
    shellcheck(job_spec.render_batch_script(spec), tmp_path_factory.mktemp("sc"))


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
    script = job_spec.render_batch_script(spec)
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


# -- real enn-submit processes: refused before torch, nothing written ------------------------

FAKE_TORCH = "raise SystemExit(97)  # enn-submit imported torch where it must not\n"


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A PYTHONPATH entry whose `torch` exits 97 on import."""
    path = tmp_path_factory.mktemp("no-torch")
    (path / "torch").mkdir()
    (path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return path


def enn_submit(args, cwd: Path, no_torch: Path, timeout: float = 60):
    env = dict(os.environ, PYTHONPATH=f"{no_torch}{os.pathsep}{ROOT}")
    env.pop("ENN_SITE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "enn_cluster.cli", *args], cwd=cwd, env=env,
                          capture_output=True, timeout=timeout)


def refused_in_one_line(res) -> str:
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "\x1b" not in err, "a terminal escape sequence reached stderr"
    assert err.startswith("enn-submit"), err
    return err


def snapshot(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture
def workdir(tmp_path_factory):
    """A fresh working directory with a valid config (runs_root inside it, not yet made)."""
    def make():
        cwd = tmp_path_factory.mktemp("cwd")
        cfg = small_config(cwd, "r", training={"max_steps": 1})
        (cwd / "run.yaml").write_text(yaml.safe_dump(cfg))
        return cwd
    return make


def _flag(name, values):
    return st.tuples(st.just(name), values).map(list)


RENDER_FLAGS = st.lists(st.one_of(
    _flag("--job-name", ARGV_SAFE | st.sampled_from(["enn-x", "ü.v1"])),
    _flag("--mount", ARGV_SAFE | st.sampled_from(["/data:/data:ro", "/a:/b:rw"])),
    _flag("--container", st.sampled_from(["none", "/img/enn.sqsh", "nvcr.io#nvidia/pytorch:24.05"])
          | ARGV_SAFE),
    _flag("--set", st.tuples(st.sampled_from(["run_name=", "runs_root=/tmp/", "training.lr=",
                                              "model.kwargs.k="]), ARGV_SAFE).map("".join)),
    _flag("--partition", ARGV_SAFE), _flag("--time", ARGV_SAFE | st.sampled_from(["30", "2-00"])),
    _flag("--nodes", ARGV_SAFE | st.sampled_from(["2", "1-3", "0", "-1"])),
    _flag("--python", ARGV_SAFE), _flag("--signal-grace", ARGV_SAFE | st.sampled_from(["0", "30"])),
), max_size=4).map(lambda pairs: [a for pair in pairs for a in pair])


@PROCS
@given(flags=RENDER_FLAGS)
def test_render_with_hostile_flags(workdir, no_torch, flags):
    """`enn-submit render` never imports torch, writes nothing, and either prints a script
    that passes shellcheck or refuses in one line."""
    cwd = workdir()
    before = snapshot(cwd)
    res = enn_submit(["render", "run.yaml", "--cluster", "slurm", *flags], cwd, no_torch)
    assert res.returncode in (0, 2), res.stderr.decode(errors="replace")
    assert snapshot(cwd) == before, "render wrote files"
    event(f"exit {res.returncode}")
    if res.returncode == 2:
        refused_in_one_line(res)
    else:
        text = res.stdout.decode("utf-8", "surrogateescape")
        scratch = Path(str(cwd) + "-sc")
        scratch.mkdir()
        shellcheck(text, scratch)


BAD_MUTATIONS = st.one_of(
    st.tuples(st.sampled_from(["training", "model", "data", "parallel", "checkpoint", "logging"]),
              HOSTILE.filter(lambda k: k not in ("kwargs",)), ANY).map(
        lambda t: {t[0]: {"unknown_" + t[1]: t[2]}}),
    st.tuples(st.sampled_from(["training.epochs", "training.per_device_train_batch_size",
                               "model.d_model", "checkpoint.keep_last", "logging.every_steps",
                               "parallel.procs_per_node"]),
              st.integers(max_value=0) | HOSTILE | FLOATS).map(lambda t: _nested(*t)),
    st.tuples(st.sampled_from(["training.seed", "data.synthetic.seed"]),
              st.integers(max_value=-1) | st.integers(min_value=2**32)).map(lambda t: _nested(*t)),
    st.tuples(st.sampled_from(["training.lr", "parallel.timeout_s", "model.dropout",
                               "data.eval_fraction", "parallel.stop_grace_s"]),
              st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, "x", [1]])
              ).map(lambda t: _nested(*t)),
    st.tuples(st.sampled_from(["parallel.timeout_s", "model.dropout", "data.eval_fraction",
                               "parallel.stop_grace_s", "training.warmup_ratio"]),
              st.sampled_from([1e300, 10**30])).map(lambda t: _nested(*t)),
    st.tuples(st.sampled_from(["run_name"]),
              st.sampled_from(["", "a/b", "..", "x" * 300]) | HOSTILE.map(lambda t: t + "\n"))
    .map(lambda t: _nested(*t)),
    st.just({"data": {"synthetic": {"n_samples": 10**12}}}),
)


def _nested(key: str, value):
    out: dict = {}
    node = out
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@PROCS
@given(mutation=BAD_MUTATIONS, slurm=st.booleans())
def test_train_with_a_bad_config_is_refused_before_torch(workdir, no_torch, mutation, slurm):
    cwd = workdir()
    cfg = _merge(yaml.safe_load((cwd / "run.yaml").read_text()), mutation)
    (cwd / "run.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    extra = ["--cluster", "slurm", "--container", "none"] if slurm else []
    res = enn_submit(["train", "--config", "run.yaml", *extra], cwd, no_torch)
    refused_in_one_line(res)
    assert snapshot(cwd / "runs") == [], "a refused config left something in runs_root"


BAD_JOB_NAMES = ARGV_SAFE.filter(lambda t: not job_spec._NAME.match(t))
BAD_MOUNTS = ARGV_SAFE.filter(lambda t: any(c in t for c in " '\"$`;\n,") or not t.startswith("/"))


@PROCS
@given(job_name=st.none() | BAD_JOB_NAMES, mount=st.none() | BAD_MOUNTS,
       run_name=st.none() | ARGV_SAFE.filter(lambda t: any(c in t for c in " '\"$`;,:")))
def test_slurm_train_with_hostile_flags_is_refused_before_the_run_exists(
        workdir, no_torch, job_name, mount, run_name):
    if job_name is None and mount is None and run_name is None:
        job_name = "$(touch CANARY_x)"
    cwd = workdir()
    args = ["train", "--config", "run.yaml", "--cluster", "slurm",
            "--container", "none" if mount is None else "/img/enn.sqsh"]
    args += ["--job-name", job_name] if job_name is not None else []
    args += ["--mount", mount] if mount is not None else []
    args += ["--set", f"run_name={run_name}"] if run_name is not None else []
    refused_in_one_line(enn_submit(args, cwd, no_torch))
    assert snapshot(cwd / "runs") == []
    assert not list(cwd.glob("CANARY*"))


@pytest.mark.parametrize("args, needle", [
    (["train", "--config", "bin.yaml"], "--config: bin.yaml is not UTF-8"),
    (["train", "--config", "."], "--config: . is a directory"),
    (["render", "sub"], "--config: sub is a directory"),
    (["train", "--config", "a\nb.yaml"], "a\\nb.yaml does not exist"),
    (["train", "--config", "run.yaml", "--gpus-per-node", "abc"], "invalid int value: 'abc'"),
    (["train", "--config", "run.yaml", "--cluster", "mars"], "argument --cluster"),
    (["train", "--config", "run.yaml", "--set", "model.hidden_sizes=&a [*a]"], "nested deeper"),
    (["train", "--config", "run.yaml", "--set", "run_name=" + "x" * 300], "run_name: 300 bytes"),
    (["train", "--config", "run.yaml", "--set", "data.synthetic.seed=-1"], "data.synthetic.seed"),
    (["train", "--config", "run.yaml", "--set", "training.seed=" + "9" * 30], "training.seed"),
    (["train", "--config", "run.yaml", "--set", "data.synthetic.n_samples=" + "9" * 15],
     "data.synthetic: n_samples"),
    (["train", "--config", "run.yaml", "--set", "parallel.timeout_s=1e300"], "parallel.timeout_s"),
    (["train", "--config", "run.yaml", "--set", "parallel.stop_grace_s=-1"], "stop_grace_s"),
    (["train", "--config", "run.yaml", "--set", "training.lr=.nan"], "training.lr: nan"),
    (["train", "--config", "run.yaml", "--set", "run_name=a\x01b"], "control character"),
    (["train", "--config", "run.yaml", "--runs-root", "run.yaml/x"], "runs_root: cannot create"),
    (["train", "--config", "run.yaml", "--cluster", "slurm", "--container", "none",
      "--set", "run_name=a b"], "RUN_DIR: run directory"),
    (["train", "--config", "run.yaml", "--cluster", "slurm", "--container", "none",
      "--time", "$(touch CANARY_t)"], "--time: '$(touch CANARY_t)' is not a time"),
    (["render", "run.yaml", "--container", "/i.sqsh", "--mount", "/a b:/a"], "--container-mounts"),
    ([], "required: command"),
])
def test_inputs_that_crashed_before(workdir, no_torch, args, needle):
    """Each of these once ended in a traceback (or left a run behind): now one line."""
    cwd = workdir()
    (cwd / "bin.yaml").write_bytes(b"\xff\xfe garbage")
    (cwd / "sub").mkdir()
    line = refused_in_one_line(enn_submit(args, cwd, no_torch))
    assert needle in line, line
    assert snapshot(cwd / "runs") == []
    assert not list(cwd.glob("CANARY*"))


def test_default_job_name_from_a_run_name_with_spaces():
    from enn_cluster.submit_slurm import default_job_name

    assert default_job_name("my run=1 ü") == "enn-my_run_1_ü"
    assert job_spec._NAME.match(default_job_name("$(x);`y`"))
    assert len(default_job_name("x" * 200)) == 64


def test_hostile_run_name_trains_locally_verbatim(tmp_path):
    """A run name is only a directory name on the local path: any text without '/' works,
    arrives verbatim, and nothing in it executes."""
    name = "a b 'c' \"d\" $(touch CANARY_1) `touch CANARY_2`; ü ✓ ,:=%"
    cfg = small_config(tmp_path, name, training={"max_steps": 1},
                       parallel={"nodes": 1, "procs_per_node": 1})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.cli", "train", "--config",
                          "run.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / name
    assert (run / "checkpoints" / "step-1" / "commit.json").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["run_name"] == name
    assert not list(tmp_path.rglob("CANARY*"))
    status = subprocess.run([sys.executable, "-m", "enn_cluster.cli", "status", str(run)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "step-1" in status.stdout, status.stdout + status.stderr


def test_config_module_bounds_are_documented_in_errors():
    """The limits the fuzzing found necessary exist and are what the messages say."""
    assert config_checks.MAX_SEED == 2**32 - 1
    with pytest.raises(UserError, match="between 0 and 4294967295"):
        config_from_dict({"training": {"seed": 2**32}})
    assert config_from_dict({"training": {"seed": 2**32 - 1}}).training.seed == 2**32 - 1
    with pytest.raises(UserError, match="not a finite number"):
        config_from_dict({"training": {"lr": 10**400}})


def test_every_hostile_piece_at_once_renders_clean(tmp_path):
    """Each piece, and each pair, in env values, srun arguments and the interpreter: the
    script passes shellcheck (values shellcheck would flag carry a directive saying they
    are literal) and bash reads every value back byte-for-byte."""
    pieces = [p for p in PIECES if p not in ("\n", "\r")] + ["a'b", "\\'", "'\\", "'$x'"]
    tricky = ["'", '"', "\\", "$x", "`", "=", ",", "~", " ", "#", "!", "-"]
    values = pieces + [a + b for a, b in itertools.permutations(tricky, 2)]
    spec = JobSpec(job_name="j", run_dir="/r", env={f"V{i}": v for i, v in enumerate(values)},
                   extra_srun_args=tuple(f"--comment={v}" for v in values),
                   python="/opt/py " + "".join(pieces), nccl_profile="ib")
    script = job_spec.render_batch_script(spec)
    shellcheck(script, tmp_path)
    lines = job_spec.env_lines(spec) + ['printf "%s\\0"' + "".join(
        f' "$V{i}"' for i in range(len(values)))]
    done = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.stdout.decode().split("\0")[:-1] == values
    assert not list(tmp_path.glob("CANARY*"))
