"""Small things a new user meets first (issue 26 section 5): a pipe closed early, a command
run before there is anything to act on, a warning on every API call."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from helpers import ROOT, cli, small_config, train_tiny, write_config


def test_status_piped_into_a_reader_that_leaves_ends_quietly(tmp_path):
    run = train_tiny(tmp_path, "piped")
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "status", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # `| head -0`
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_commands_before_their_inputs_exist_say_what_to_run_first(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "fresh", parallel={
        "nodes": 1, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "fresh"
    res = cli("collect", run, "--out", tmp_path / "o.npy")
    assert res.returncode == 2 and "no predictions yet" in res.stderr and \
        "enn-submit predict" in res.stderr and "--name" not in res.stderr, res.stderr
    res = cli("export", run, "--out", tmp_path / "art")
    assert res.returncode == 2 and "RUN_DIR:" in res.stderr and "--step" not in res.stderr, \
        res.stderr


def test_loading_a_model_in_one_process_warns_nothing(tmp_path):
    from enn_cluster import Run

    run = train_tiny(tmp_path, "quiet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Run.open(run).load_model()


@pytest.mark.slow
def test_typos_get_a_did_you_mean(tmp_path):
    """Subcommands, flag choices, config keys (--set and YAML), config choices and site
    keys: the closest valid name, in the one line that refuses the typo."""
    res = cli("trian")
    assert res.returncode == 2 and "(did you mean train?)" in res.stderr, res.stderr
    res = cli("train", "--cluster", "slrum")
    assert res.returncode == 2 and "(did you mean slurm?)" in res.stderr, res.stderr
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "typo"))
    res = cli("prepare", "--config", cfg, "--set", "trainng.lr=1e-3")
    assert res.returncode == 2 and "trainng: unknown key (did you mean training?)" in res.stderr
    res = cli("prepare", "--config", cfg, "--set", "training.nonfinite_polcy=skip")
    assert "(did you mean nonfinite_policy?)" in res.stderr, res.stderr
    res = cli("prepare", "--config", cfg, "--set", "model.task=regresion")
    assert "(did you mean regression?)" in res.stderr, res.stderr
    yaml_typo = write_config(tmp_path / "typo.yaml", **small_config(
        tmp_path, "typo", checkpoint={"every_step": 4}))
    res = cli("prepare", "--config", yaml_typo)
    assert "checkpoint.every_step: unknown key (did you mean every_steps?)" in res.stderr
    site_file = tmp_path / "site.yaml"
    site_file.write_text("partiton: gpu\n")
    res = cli("prepare", "--config", cfg, "--site", site_file)
    assert res.returncode == 2 and "site.partiton: unknown key (did you mean partition?)" \
        in res.stderr, res.stderr
    res = cli("prepare", "--config", cfg, "--set", "training.zzz=1")
    assert res.returncode == 2 and "did you mean" not in res.stderr  # nothing close: no guess
    assert not (tmp_path / "runs").exists()  # nothing written


def test_system_deps_takes_the_pyxis_enroot_sources_from_a_given_folder(tmp_path):
    """`make system-deps PYXIS_ENROOT_SRC=DIR` runs DIR/install.sh; without the folder it
    says where it looked and how to name another (the install function, run alone)."""
    script = ROOT / "slurm" / "dev" / "install-deps.sh"
    body = "\n".join(line for line in script.read_text().splitlines()
                     if line not in ("install_packages", "install_pyxis_enroot"))
    src = tmp_path / "pyxis src"
    src.mkdir()
    (src / "install.sh").write_text(f"echo built enroot; touch {str(tmp_path / 'ran')!r}\n")

    def install(env):
        return subprocess.run(["bash", "-c", body + "\ninstall_pyxis_enroot"], env=env,
                              capture_output=True, text=True, timeout=30)

    res = install({"PATH": "/usr/bin:/bin", "PYXIS_ENROOT_SRC": str(src)})
    assert res.returncode == 0 and "built enroot" in res.stdout and (tmp_path / "ran").exists()
    res = install({"PATH": "/usr/bin:/bin", "PYXIS_ENROOT_SRC": str(tmp_path / "none")})
    assert res.returncode == 0 and f"no {tmp_path / 'none'}/install.sh" in res.stdout
    assert "PYXIS_ENROOT_SRC=DIR" in res.stdout
    dry = subprocess.run(["make", "-n", "system-deps", f"PYXIS_ENROOT_SRC={src}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert f'PYXIS_ENROOT_SRC="{src}" bash slurm/dev/install-deps.sh' in dry.stdout, dry.stdout


@pytest.mark.slow
def test_api_errors_name_the_api_arguments(tmp_path):
    """A plain script calling the API reads its own argument names in an error, never the
    CLI's flags or RUN_DIR."""
    run = train_tiny(tmp_path, "api")
    script = f"""
import numpy as np, enn_cluster
from enn_cluster.errors import UserError
calls = [
    lambda: enn_cluster.Run.open({str(tmp_path / 'missing')!r}),
    lambda: enn_cluster.predict({str(run)!r}, np.zeros((3, 5), np.float32)),
    lambda: enn_cluster.predict({str(tmp_path / 'missing')!r}, np.zeros((3, 8), np.float32)),
    lambda: enn_cluster.export({str(run)!r}, {str(tmp_path / 'art')!r}, format="onnx"),
    lambda: enn_cluster.Run.open({str(run)!r}).load_model(step=7),
]
for call in calls:
    try:
        call()
        print("NO ERROR")
    except (UserError, FileNotFoundError) as exc:
        print(type(exc).__name__, exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 5, done.stdout + done.stderr
    assert lines[0].startswith("UserError Run.open(path): "), lines[0]
    assert lines[1].startswith("UserError X: rows have shape"), lines[1]
    assert lines[2].startswith("UserError run_or_dir: "), lines[2]
    assert lines[3].startswith("UserError format: 'onnx'"), lines[3]
    assert lines[4].startswith("UserError step: step-7 is not a complete checkpoint"), lines[4]
    assert "RUN_DIR" not in done.stdout and "--" not in done.stdout, done.stdout


@pytest.mark.slow
def test_status_follow_shows_a_starting_launch_and_follows_it(tmp_path):
    """Between a launcher taking the run lock and its workers' first `start` record,
    `status --follow` says the launch is starting and keeps following; it ends once the
    lock is released. (The lock is this test process's own: a launcher that imports.)"""
    import json
    import time

    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.storage.run_lock import acquire_lock, lock_owner, release_lock

    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "follow", parallel={
        "nodes": 1, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = RunDir(tmp_path / "runs" / "follow")
    owner = acquire_lock(run, lock_owner())
    try:
        proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "status",
                                 str(run.path), "--follow", "--interval", "0.1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)
        first = proc.stdout.readline()
        assert "starting (launcher pid" in first and "not running" not in first, first
        assert proc.poll() is None  # still following
        record = {"kind": "start", "time": time.time(), "step": 0, "total_steps": 5}
        with open(run.metrics, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        second = proc.stdout.readline()
        assert second.startswith("step -/5") and second.rstrip().endswith("| running"), second
    finally:
        release_lock(run, owner)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.rstrip().endswith("not running"), out + err


@pytest.mark.parametrize("command", [("status",), ("resume",), ("plot",), ("cancel",),
                                     ("verify",), ("doctor",),
                                     ("predict", "--input", "x.npy")])
def test_every_run_dir_a_user_names_takes_a_tilde(tmp_path, command):
    """RUN_DIR as a shell would leave it quoted ('~/r1'): every command expands it as
    `Run.open` does (issue 41 section 4), and a path that is no run says so, expanded."""
    home = tmp_path / "home"
    (home / "r1").mkdir(parents=True)
    res = cli(command[0], "~/r1", *command[1:], env={"HOME": str(home)})
    assert res.returncode == 2, res.stderr
    assert f"RUN_DIR: {home / 'r1'} is not a run directory" in res.stderr, res.stderr


def test_the_api_predicts_a_run_named_with_a_tilde(tmp_path, monkeypatch):
    import numpy as np

    import enn_cluster

    (tmp_path / "home").mkdir()
    run = train_tiny(tmp_path / "home", "r1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    x = np.zeros((3, 8), np.float32)
    out = enn_cluster.predict(f"~/{run.relative_to(tmp_path / 'home')}", x)
    assert out.shape[0] == 3
