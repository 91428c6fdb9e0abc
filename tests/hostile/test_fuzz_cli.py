"""Fuzzed bad input through real `enn-submit` processes: what must be refused is refused
before torch is imported (a fake `torch` package on PYTHONPATH makes any import of it exit
97), in one line with exit code 2, with nothing written; what is accepted is quoted.
In-process fuzzing of the same surfaces: tests/hostile/test_fuzz_input.py.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import event, example, given
from hypothesis import strategies as st

from enn_cluster.config import checks as config_checks
from enn_cluster.cluster import job_spec
from enn_cluster.cluster import job_script
from enn_cluster.config.loading import config_from_dict
from enn_cluster.errors import UserError
from enn_cluster.cluster.job_spec import JobSpec
from fuzz_support import ANY, ARGV_SAFE, FLOATS, HOSTILE, PIECES, PROCS, RENDER_FLAGS, shellcheck
from helpers import ROOT, small_config

# -- real enn-submit processes: refused before torch, nothing written ------------------------

FAKE_TORCH = "raise SystemExit(97)  # enn-submit imported torch where it must not\n"


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A PYTHONPATH entry whose `torch` exits 97 on import."""
    path = tmp_path_factory.mktemp("no-torch")
    (path / "torch").mkdir()
    (path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return path


def _slurm_answers() -> Path:
    """A directory holding an scontrol whose ping says the controller is up: `--cluster
    slurm` checks that first, and these inputs are about what comes after, whether or not a
    Slurm controller happens to run on this machine."""
    import tempfile

    from helpers import controller_up_scontrol

    global _SLURM_BIN
    if _SLURM_BIN is None:
        _SLURM_BIN = Path(tempfile.mkdtemp(prefix="enn-fuzz-slurm-"))
        controller_up_scontrol(_SLURM_BIN)
    return _SLURM_BIN


_SLURM_BIN = None


def enn_submit(args, cwd: Path, no_torch: Path, timeout: float = 60):
    env = dict(os.environ, PYTHONPATH=f"{no_torch}{os.pathsep}{ROOT}",
               PATH=f"{_slurm_answers()}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    env.pop("ENN_SITE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", *args], cwd=cwd, env=env,
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


@PROCS
@given(flags=RENDER_FLAGS)
@example(flags=["--container", "none", "--python", "$(touch CANARY_a)"])  # once drawn, failed
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
        # submitit writes the interpreter into its srun line itself (quoted by us, as
        # test_rendered_scripts_run's hostile interpreter shows arriving intact), with no
        # room for our "literal text" directive: SC2016 on a $ or ` there is that literal
        python = flags[flags.index("--python") + 1] if "--python" in flags else ""
        literal = ("SC2016",) if "--admin" not in flags and any(c in python for c in "$`") \
            else ()
        shellcheck(text, scratch, literal)


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
    (["render", "run.yaml", "--container", "/i.sqsh", "--mount", "/a b:/a"], "--mount"),  # the flag typed
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
    from enn_cluster.cluster.submit_slurm import default_job_name

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
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                          "run.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / name
    assert (run / "checkpoints" / "step-1" / "commit.json").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["run_name"] == name
    assert not list(tmp_path.rglob("CANARY*"))
    status = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "status", str(run)],
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
    script = job_script.render_batch_script(spec)
    shellcheck(script, tmp_path)
    lines = job_script.env_lines(spec) + ['printf "%s\\0"' + "".join(
        f' "$V{i}"' for i in range(len(values)))]
    done = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.stdout.decode().split("\0")[:-1] == values
    assert not list(tmp_path.glob("CANARY*"))
