"""Secrets and permissions (issue "Fault injection and bad input").

- Tokens (anything named *TOKEN*, *SECRET*, *PASSWORD*, *KEY*) pass through the environment
  and never land in rendered scripts, frozen configs, logs or metrics of a real run.
- A run directory is group-readable and never world-writable, whatever the caller's umask
  (the subprocesses here run with umask 000: the code sets modes, it does not inherit them).
- Nothing in enn_cluster unpickles arbitrary objects from a run directory: every torch.load
  uses weights_only=True, and DCP checkpoints load through an allow-list reader (DCP's own
  FileSystemReader reads `.metadata` with plain pickle.load, and its planner reads
  non-tensor entries with torch.load(weights_only=False)).
"""
from __future__ import annotations

import ast
import io
import os
import pickle
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from enn_cluster.errors import UserError
from helpers import ROOT, small_config

SECRET_NAMES = ("MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                "WANDB_API_KEY", "GITHUB_TOKEN", "MY_SECRET")
PACKAGE = ROOT / "enn_cluster"


def secrets() -> dict[str, str]:
    """Fresh values per test: a hit can only come from this test's environment."""
    return {name: f"s3cr3t-{name.lower()}-{uuid.uuid4().hex}" for name in SECRET_NAMES}


def enn_submit(args, cwd, env_extra, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    env.pop("ENN_SITE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: os.umask(0))  # prove modes are set, not inherited


def leaks(root: Path, values) -> list[str]:
    """'FILE: NAME' for every file under root holding one of the secret values."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {v}" for v in values if v.encode() in data]
    return found


# -- rendered scripts -----------------------------------------------------------------------


@pytest.mark.parametrize("flags", [
    ["--container", "none"],
    ["--container", "/shared/images/enn.sqsh", "--mount", "/data:/data:ro"],
    ["--task", "predict", "--name", "holdout", "--container", "/shared/images/enn.sqsh"],
])
def test_env_secrets_never_reach_a_rendered_script(tmp_path, flags):
    tokens = secrets()
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"partition": "gpu", "setup_lines": ["module load nccl"],
                                    "extra_srun_args": ["--cpu-bind=none"]}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(small_config(tmp_path, "sec")))
    res = enn_submit(["render", "run.yaml", "--cluster", "slurm", "--site", site, *flags],
                     tmp_path, tokens, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --job-name=enn-sec" in res.stdout
    for value in tokens.values():
        assert value not in res.stdout + res.stderr
    assert not (tmp_path / "runs").exists(), "render wrote a run directory"


def test_env_secrets_never_reach_the_submitit_script(tmp_path, monkeypatch):
    """The other way a job reaches Slurm: submitit's parameters and the sbatch file it
    writes into RUN_DIR/slurm/ (built here without sbatch)."""
    from enn_cluster.cluster import job_script
    from enn_cluster.client.cli import build_parser
    from enn_cluster.client.cli_ops import slurm_request
    from enn_cluster.client.launch_plan import plan_shape
    from enn_cluster.config.launch_shape import LaunchShape
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.storage.rundir import run_dir_for
    from render_support import make_submitit_script

    tokens = secrets()
    for name, value in tokens.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ENN_SITE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    site = tmp_path / "site.yaml"
    site.write_text("partition: gpu\n")
    args = build_parser().parse_args(["train", "--cluster", "slurm", "--container",
                                      "/shared/images/enn.sqsh", "--site", str(site)])
    cfg = config_from_dict(small_config(tmp_path, "sec"))
    spec = plan_shape(cfg, LaunchShape(2, 2), slurm=slurm_request(args)).for_job(
        run_dir_for(cfg).path).spec
    text = repr(job_script.submitit_parameters(spec)) + repr(job_script.submitit_executor_kwargs(spec))
    text += make_submitit_script(spec, str(tmp_path / "submitit"))
    text += job_script.render_batch_script(spec)
    for value in tokens.values():
        assert value not in text


# -- frozen configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["model.kwargs.hf_token={value}",
                                      "data.eval_path=s3://AKIAEXAMPLE:{value}@bucket/x.npz"])
def test_a_secret_in_a_config_field_is_not_frozen(tmp_path, override):
    from enn_cluster.config.loading import load_config
    from enn_cluster.storage.rundir import create_run_dir

    value = secrets()["HF_TOKEN"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(small_config(tmp_path, "frozen")))
    with pytest.raises(UserError) as refused:
        create_run_dir(load_config(str(path), [override.format(value=value)]))
    assert override.split("=")[0] in str(refused.value) and value not in str(refused.value)
    assert not (tmp_path / "runs").exists()


# -- a real local run: no secret anywhere, modes set by the code -------------------------------


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Train 1 node x 2 processes for 2 steps, then resume on 1 process with an override:
    tokens in the environment, umask 000 in both processes."""
    tmp = tmp_path_factory.mktemp("secrets-run")
    tokens = secrets()
    cfg = small_config(tmp, "sec", training={"max_steps": 2},
                       checkpoint={"every_steps": 1, "keep_last": 5},
                       parallel={"nodes": 1, "procs_per_node": 2})
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    train = enn_submit(["train", "--config", "run.yaml"], tmp, tokens)
    assert train.returncode == 0, train.stderr
    run = tmp / "runs" / "sec"
    resume = enn_submit(["resume", run, "--procs-per-node", "1", "--set",
                         "training.max_steps=3"], tmp, tokens)
    assert resume.returncode == 0, resume.stderr
    import numpy as np

    np.save(tmp / "in.npy", np.zeros((16, 8), np.float32))
    after = [enn_submit(["predict", run, "--input", tmp / "in.npy", "--procs-per-node", "1"],
                        tmp, tokens), enn_submit(["plot", run], tmp, tokens)]
    assert [p.returncode for p in after] == [0, 0], after[0].stderr + after[1].stderr
    assert (run / "metrics.png").exists() and list((run / "predictions").iterdir())
    return run, tokens, "".join(p.stdout + p.stderr for p in [train, resume, *after])


def test_no_secret_in_any_file_of_the_run(real_run):
    run, tokens, output = real_run
    assert (run / "checkpoints" / "step-3" / "commit.json").exists()
    assert list((run / "config-history").iterdir()), "the resume re-froze the config"
    assert leaks(run, tokens.values()) == []
    for value in tokens.values():
        assert value not in output


def test_run_directory_modes_do_not_follow_the_umask(real_run):
    """umask 000 in the launcher: still directories 2750 (setgid: files keep the run's
    group) and files 0640 - group-readable, nothing for others, nothing world-writable."""
    run, _, _ = real_run
    bad = []
    for path in [run, *run.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        perms = stat.S_IMODE(mode)
        if mode & stat.S_IWOTH or not mode & stat.S_IRGRP:
            bad.append(f"{oct(perms)} {path.relative_to(run.parent)} "
                       "(world-writable or not group-readable)")
        elif stat.S_ISDIR(mode) and perms != 0o2750:
            bad.append(f"{oct(perms)} {path.relative_to(run.parent)}/ (want 0o2750)")
        elif stat.S_ISREG(mode) and perms != 0o640:
            bad.append(f"{oct(perms)} {path.relative_to(run.parent)} (want 0o640)")
    assert bad == []


# -- no arbitrary unpickling ------------------------------------------------------------------


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = ast.unparse(func)
            yield node, name


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_torch_load_uses_weights_only_true():
    found, bad = 0, []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch") \
                    and any(a.name == "load" for a in node.names):
                bad.append(f"{path.name}:{node.lineno}: imports load from {node.module}")
        for node, name in _calls(tree):
            if name in ("torch.load", "torch.serialization.load"):
                found += 1
                kw = {k.arg: k.value for k in node.keywords}
                value = kw.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if name in ("np.load", "numpy.load"):
                kw = {k.arg: k.value for k in node.keywords}
                if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant)
                                                 and kw["allow_pickle"].value is False):
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found >= 1, "no torch.load found: is the scan looking at the package?"
    assert bad == []


# Files allowed to unpickle, and why. Anything new here needs a review.
PICKLE_ALLOWED = {
    "model_structure.py": "enn_cluster.train(model=<nn.Module instance>) pickles the caller's "
                          "own module's structure into RUN_DIR for the workers (same user, "
                          "by design)",
    "launching.py": "the API's wait=False launcher hands its plan to its own child over a "
                    "pipe it made (same user, same process tree; nothing read from disk)",
}


def test_no_other_pickle_loading_in_the_package():
    bad = []
    for path in _sources():
        for node, name in _calls(ast.parse(path.read_text(), str(path))):
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load",
                        "cloudpickle.load") and path.name not in PICKLE_ALLOWED:
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


SAFE_READERS = ("SafeFileSystemReader",  # .metadata unpickled through the allow-list
                "HuggingFaceStorageReader")  # safetensors: JSON headers and raw tensors, no pickle


def test_dcp_loading_goes_through_the_safe_reader():
    """Every dcp.load in the package passes a reader that unpickles nothing outside the
    allow-list, and the allow-list planner."""
    bad = []
    for path in _sources():
        for node, name in _calls(ast.parse(path.read_text(), str(path))):
            if name == "dcp.load":
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if not any(r in kw.get("storage_reader", "") for r in SAFE_READERS) \
                        or "SafeLoadPlanner" not in kw.get("planner", ""):
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


class _Plant:
    """Unpickling this calls open(path, 'w'): a file appears if arbitrary code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _planted_checkpoint(src: Path, dst: Path, sentinel: Path) -> Path:
    """A copy of a real checkpoint whose `.metadata` carries a payload next to the metadata."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    md = FileSystemReader(str(src)).read_metadata()
    md.planner_data = _Plant(sentinel)  # a field DCP keeps as-is: any object fits there
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def test_dcp_metadata_payload_runs_in_torch_and_not_in_ours(real_run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from enn_cluster.storage.dcp_io import SafeFileSystemReader

    run, _, _ = real_run
    sentinel = tmp_path / "PWNED_metadata"
    bad = _planted_checkpoint(run / "checkpoints" / "step-3", tmp_path / "step-3", sentinel)
    with pytest.raises(pickle.UnpicklingError, match=r"io\.open, which a DCP checkpoint never"):
        SafeFileSystemReader(str(bad)).read_metadata()
    assert not sentinel.exists()
    # what DCP itself does (torch 2.13): plain pickle.load runs the payload
    FileSystemReader(str(bad)).read_metadata()
    assert sentinel.exists(), "DCP no longer unpickles .metadata freely: revisit the report"


def test_dcp_bytes_entries_load_only_plain_data(tmp_path):
    import torch

    from enn_cluster.storage.dcp_io import SafeLoadPlanner

    sentinel = tmp_path / "PWNED_bytes"
    buf = io.BytesIO()
    torch.save({"lr": 0.1, "payload": _Plant(sentinel)}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafeLoadPlanner().load_bytes(None, buf)
    assert not sentinel.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_safe_load_reads_a_real_checkpoint_like_dcp(real_run):
    """The allow-list reader and planner load every entry of a real checkpoint (model,
    optimizer state, param_groups) exactly as DCP's own would."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from enn_cluster.storage.dcp_io import SafeFileSystemReader, safe_load

    run, _, _ = real_run
    step = run / "checkpoints" / "step-3"
    md = SafeFileSystemReader(str(step)).read_metadata()
    assert md.state_dict_metadata.keys() == FileSystemReader(str(step)).read_metadata() \
        .state_dict_metadata.keys()

    def empty():
        return {k: None if isinstance(v, BytesStorageMetadata)
                else torch.zeros(v.size, dtype=v.properties.dtype)
                for k, v in md.state_dict_metadata.items()}

    ours, theirs = empty(), empty()
    safe_load(ours, step)
    dcp.load(theirs, checkpoint_id=str(step))
    assert any(isinstance(v, BytesStorageMetadata) for v in md.state_dict_metadata.values())
    for key in theirs:
        a, b = ours[key], theirs[key]
        assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), key


# -- credentials by what a value looks like ---------------------------------------------------


@pytest.mark.parametrize("text", [
    "postgres://u:PW0@host/db", "s3://PW0@bucket/x", "user:PW0@registry#img",
    "https://h/?api-key=PW0&x=1", "https://h/x?pwd=PW0", "https://h/#access_token=PW0",
    "https://h/x.npz?X-Amz-Signature=PW0", "Authorization: Bearer PW0abcdef",
    "['a', 'ghp_PW0abcdefghijkl']", "AKIAPW0ABCDEFGHIJKLM"])
def test_an_error_line_never_carries_a_credential(text):
    """Whatever a message quotes passes through errors.redact: the value is masked."""
    from enn_cluster.errors import looks_secret, redact

    assert looks_secret(text) and "PW0" not in redact(text)
    assert "PW0" not in str(UserError(f"--flag: {text!r} is not valid"))


@pytest.mark.parametrize("text", [
    "nvcr.io#nvidia/pytorch:24.05-py3", "user@registry#img", "img@sha256:0123abcd",
    "/shared/images/enn.sqsh", "https://h/x.npz?version=3&monkey=1", "04:00:00",
    "s3://bucket/x.npz", "model.kwargs.author", "Basic", "1-12:00:00",
    "https://h/x?design=1&signal=2&author=x"])
def test_ordinary_values_are_not_taken_for_credentials(text):
    from enn_cluster.errors import looks_secret

    assert not looks_secret(text)


@pytest.mark.parametrize("value", [[{"password": "SUPERSECRET-1"}],
                                   {"inner": [{"db": "postgres://u:SUPERSECRET-2@h/d"}]},
                                   "postgres://u:SUPERSECRET-3@h/d"])
def test_a_type_error_never_shows_a_secret_at_any_depth(value):
    """Issue 38 section 6: a wrong type names the key and the type; a container is not
    echoed (a secret may sit anywhere in it), nor a string that looks like a credential."""
    from enn_cluster.config.loading import config_from_dict

    key = "run_name" if isinstance(value, str) else "model.kwargs"
    section = {"run_name": 7} if isinstance(value, str) else {"model": {"kwargs": value}}
    if isinstance(value, str):  # a str where an int goes: data.synthetic.seed
        section = {"data": {"synthetic": {"seed": value}}}
        key = "data.synthetic.seed"
    with pytest.raises(UserError) as err:
        config_from_dict(section)
    assert str(err.value).startswith(key) and "SUPERSECRET" not in str(err.value), err.value
