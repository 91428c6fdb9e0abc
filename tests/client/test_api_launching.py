"""The seams the layout step made: the API and the CLI reach Slurm and the local launcher
through the same `client/launching.py` functions, with values rather than parsed flags."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from enn_cluster.client.api import _plan, _slurm_request
from enn_cluster.client.cli import build_parser
from enn_cluster.client.cli_ops import plan_from_flags, slurm_request
from enn_cluster.config.loading import config_from_dict
from enn_cluster.storage.rundir import run_dir_for
from helpers import ROOT, controller_up_scontrol, metrics, slurm_answers_here, small_config


def _api_job(cfg, cluster):
    """The Slurm job the API's `cluster=` dict plans for a new run of `cfg`."""
    return _plan(cfg, cluster, "train", _slurm_request(cluster)).for_job(
        run_dir_for(cfg).path).spec


def _cli_job(cfg, argv):
    """The Slurm job `enn-submit ARGV` plans for a new run of `cfg`."""
    return plan_from_flags(build_parser().parse_args(argv), cfg,
                           run_dir=run_dir_for(cfg).path).spec


def test_api_cluster_dict_and_cli_flags_build_the_same_slurm_job(tmp_path, monkeypatch):
    monkeypatch.delenv("ENN_SITE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    slurm_answers_here(tmp_path, monkeypatch)
    cfg = config_from_dict(small_config(tmp_path, "same"))
    flags = [
        "train", "--cluster", "slurm", "--nodes", "2-3", "--gpus-per-node", "4",
        "--partition", "gpu", "--account", "proj", "--time", "30", "--container", "/img/e.sqsh",
        "--mount", "/data:/data", "--exclusive", "--job-name", "exp-1"]
    cluster = {"nodes": "2-3", "gpus_per_node": 4, "partition": "gpu", "account": "proj",
               "time": "30", "container": "/img/e.sqsh", "mounts": ["/data:/data"],
               "exclusive": True, "job_name": "exp-1"}
    from_cli, from_api = _cli_job(cfg, flags), _api_job(cfg, cluster)
    assert from_api == from_cli
    assert from_cli.node_range == (2, 3) and from_cli.exclusive and from_cli.job_name == "exp-1"


def test_the_site_runs_root_places_api_and_cli_runs_alike(tmp_path, monkeypatch):
    """A site file's runs_root places a run whose config names none, whatever the caller's
    cwd: the API (with `cluster=` and locally) takes the CLI's config step, so its runs land
    where `enn-submit train` puts them, on the shared filesystem."""
    import numpy as np
    import yaml

    import enn_cluster

    shared, notebook, bin_dir = tmp_path / "shared", tmp_path / "notebook", tmp_path / "bin"
    notebook.mkdir()
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"runs_root": str(shared), "python": "python3"}))
    monkeypatch.setenv("ENN_SITE_CONFIG", str(site))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(notebook)
    config = small_config(tmp_path, "cli", parallel={"nodes": 1, "procs_per_node": 1},
                          training={"max_steps": 1})
    del config["runs_root"]
    (tmp_path / "cli.yaml").write_text(yaml.safe_dump(config))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(tmp_path / "cli.yaml"), "--cluster", "slurm", "--container", "none"],
                         capture_output=True, text=True, timeout=120, cwd=notebook,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-2000:]
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    api = {k: v for k, v in config.items() if k != "data"}
    on_slurm = enn_cluster.train("api_models:tiny", x, x[:, :1], config={**api, "run_name": "slurm"},
                                 cluster={"nodes": 1, "container": "none"}, wait=False)
    local = enn_cluster.train("api_models:tiny", x, x[:, :1], config={**api, "run_name": "local"})
    for name in ("cli", "slurm", "local"):
        assert (shared / name / "config.yaml").exists(), name
    assert (on_slurm.path, local.path) == (shared / "slurm", shared / "local")
    assert yaml.safe_load((shared / "slurm" / "config.yaml").read_text())["runs_root"] == \
        yaml.safe_load((shared / "cli" / "config.yaml").read_text())["runs_root"] == str(shared)
    assert local.latest_checkpoint == 1 and not (notebook / "runs").exists()


DETACHED = textwrap.dedent("""
    import json, sys, time
    import numpy as np, torch, enn_cluster
    x = np.random.default_rng(0).standard_normal((256, 8)).astype(np.float32)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    run = enn_cluster.train(model, x, x[:, :1] ** 2, config=json.loads(sys.argv[1]),
                            run_dir=sys.argv[2], wait=False)
    returned = time.time()
    deadline = returned + 120
    while not run.running() and time.time() < deadline:
        time.sleep(0.2)
    running = run.running()
    while run.metrics("train") == [] and time.time() < deadline:
        time.sleep(0.2)
    run.cancel()
    run.wait(timeout=120)
    print(json.dumps({"running": running, "path": str(run.path)}))
""")


def test_train_wait_false_runs_detached_and_cancel_stops_it_in_a_pid_namespace(tmp_path):
    """`wait=False` returns while a launcher of its own session trains; `Run.cancel()`
    signals that launcher (proven by its lock record), which stops at an agreed step with a
    committed checkpoint. The signal goes to a pid read from run.lock: own PID namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot isolate a test that sends signals")
    cfg = {"training": {"max_steps": 100000, "per_device_train_batch_size": 8},
           "checkpoint": {"every_steps": 0}, "parallel": {"nodes": 1, "procs_per_node": 2}}
    run = tmp_path / "runs" / "detached"
    res = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                          sys.executable, "-c", DETACHED, json.dumps(cfg), str(run)],
                         capture_output=True, text=True, timeout=400, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["running"] and out["path"] == str(run)
    saved = metrics(run, "checkpoint")
    assert saved and saved[-1]["step"] < 100000  # stopped early, with a checkpoint
    assert (run / "checkpoints" / f"step-{saved[-1]['step']}" / "commit.json").is_file()
    assert "stopped with a committed checkpoint" in (run / "logs" / "api-launcher.log").read_text()
    assert not (run / "run.lock").exists()


def test_memory_per_node_from_site_and_flag_reaches_the_job(tmp_path, monkeypatch):
    """`mem_gb` in the site config, `--mem-gb` on the command line (which wins), and the
    API's `cluster={"mem_gb": ...}` all become sbatch's --mem."""
    from enn_cluster.cluster import job_script

    monkeypatch.chdir(tmp_path)
    slurm_answers_here(tmp_path, monkeypatch)
    site = tmp_path / "site.yaml"
    site.write_text("mem_gb: 32\n")
    monkeypatch.setenv("ENN_SITE_CONFIG", str(site))
    cfg = config_from_dict(small_config(tmp_path, "mem"))
    base = ["train", "--cluster", "slurm", "--container", "/img/e.sqsh", "--nodes", "2"]
    from_site, from_flag = _cli_job(cfg, base), _cli_job(cfg, base + ["--mem-gb", "64"])
    from_api = _api_job(cfg, {"nodes": 2, "container": "/img/e.sqsh", "mem_gb": 0})
    assert (from_site.mem_gb, from_flag.mem_gb, from_api.mem_gb) == (32, 64, 0)
    assert "#SBATCH --mem=64G" in job_script.render_batch_script(from_flag) or \
        "--mem=64" in job_script.render_batch_script(from_flag)
    bad = tmp_path / "bad.yaml"
    bad.write_text("mem_gb: lots\n")
    monkeypatch.setenv("ENN_SITE_CONFIG", str(bad))
    with pytest.raises(Exception, match="site.mem_gb"):
        slurm_request(build_parser().parse_args(base))


def test_an_sbatch_reply_without_a_job_id_is_one_line_and_leaves_no_run(tmp_path):
    """A site wrapper whose sbatch prints no 'Submitted batch job N': exit 2, one line,
    and the run directory this command made is gone (nothing ran in it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'queued, thanks'\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    cfg = tmp_path / "run.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(small_config(tmp_path, "noid")))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    env.pop("ENN_SITE_CONFIG", None)
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(cfg), "--cluster", "slurm", "--container", "none"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "queued, thanks" in errors[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "runs" / "noid").exists()


def test_the_api_refuses_as_the_cli_does_and_leaves_no_run(tmp_path, monkeypatch):
    """The API goes through the CLI's steps (launching.create_train_run,
    removed_if_never_run, prediction_request.check_prediction_inputs): a job Slurm cannot
    take is refused before the run exists, a refused sbatch leaves no run, and a prediction
    whose input file is unusable writes nothing."""
    import numpy as np
    import torch

    import enn_cluster
    from enn_cluster.errors import UserError

    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    y = x[:, :1].copy()
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    runs = tmp_path / "runs"
    monkeypatch.delenv("SLURM_CONF", raising=False)  # this machine's Slurm: none configured
    with pytest.raises(UserError, match="Slurm is not configured on this machine|this "
                                        "machine has no Slurm"):  # before the partition
        enn_cluster.train(model, x, y, run_dir=str(runs / "bad"),
                          cluster={"nodes": 1, "container": "none",
                                   "partition": "gpu\n#SBATCH --uid=0"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: refused' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    site = tmp_path / "site.yaml"
    site.write_text("python: python3\n")
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        m.setenv("ENN_SITE_CONFIG", str(site))
        with pytest.raises(UserError, match="partition"):
            enn_cluster.train(model, x, y, run_dir=str(runs / "bad"),
                              cluster={"nodes": 1, "container": "none",
                                       "partition": "gpu\n#SBATCH --uid=0"})
        assert not runs.exists() or not any(runs.iterdir())
        with pytest.raises(UserError, match="sbatch refused the job: sbatch: error: refused"):
            enn_cluster.train(model, x, y, run_dir=str(runs / "refused"),
                              cluster={"nodes": 1, "container": "none"})
    assert not (runs / "refused").exists()

    run = enn_cluster.train(model, x, y, run_dir=str(runs / "ok"),
                            training={"max_steps": 1}, parallel={"nodes": 1, "procs_per_node": 1})
    before = sorted(p.name for p in (run.path / "predictions").glob("*")) \
        if (run.path / "predictions").exists() else []
    with pytest.raises(UserError, match="^X: "):
        enn_cluster.predict(run, str(tmp_path / "missing.npy"))
    after = sorted(p.name for p in (run.path / "predictions").glob("*")) \
        if (run.path / "predictions").exists() else []
    assert after == before


def test_the_detached_launcher_is_handed_the_plan_itself(tmp_path):
    """Issue 41 section 2: `wait=False`'s child gets the caller's LaunchPlan (pickled on its
    stdin), not a description it rebuilds: here a plan for a directory with no config.yaml,
    which the child could not have read back, reaches the local launcher and is refused by
    the run lock a live process (this test) holds: one line in its log, exit 2."""
    import socket

    from enn_cluster.client.launch_plan import plan_shape
    from enn_cluster.client.launching import launch_detached
    from enn_cluster.config.launch_shape import LaunchShape
    from enn_cluster.storage.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    lock = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": 0})
    run.lock_path.write_text(lock)
    plan = plan_shape(config_from_dict(small_config(tmp_path, "run")), LaunchShape(1, 1))
    child = launch_detached(run, plan)
    assert child.wait(timeout=120) == 2
    said = (run.logs / "api-launcher.log").read_text()
    assert f"enn-submit: error: run directory {run.path} is in use by pid {os.getpid()}" in said
    assert "Traceback" not in said and run.lock_path.read_text() == lock
