"""`enn-submit render` prints, byte for byte, the batch script that `train --cluster slurm`
hands to sbatch: compared with what the real local Slurm stored for the job."""
from __future__ import annotations

import pytest

from enn_cluster.storage import layout

from helpers import cli, small_config, write_config

FLAGS = ("--container", "none", "--time", "10", "--nodes", "1-2", "--gpus-per-node", "2",
         "--partition", "debug", "--max-restarts", "3")


def _render(target, *extra, env=None) -> str:
    res = cli("render", target, *FLAGS, *extra, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.slurm
def test_render_equals_the_script_slurm_runs(slurm_cluster, tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "same"))
    before = _render(cfg)  # from the config, before the run directory exists
    assert not (tmp_path / "runs").exists()
    res = cli("train", "--config", cfg, "--cluster", "slurm", *FLAGS, timeout=120)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().splitlines()[-1]
    try:
        stored = slurm_cluster.run(["scontrol", "write", "batch_script", job, "-"])
        assert stored.returncode == 0, stored.stderr
    finally:
        slurm_cluster.run(["scancel", job])
    run = tmp_path / "runs" / "same"
    after = _render(run)
    assert stored.stdout == after == before
    assert f" -u -m submitit.core._submit {run}/slurm/%j\n" in after
    assert "#SBATCH --nodes=1-2" in after and "ENN_MAX_RESTARTS=3" in after


def test_render_is_the_submitit_script_and_writes_nothing(tmp_path):
    """Without Slurm: render's text is submitit's script for the run's folder, not the
    admin template, and it leaves no file behind."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "dry"))
    text = _render(cfg, "--container", "/shared/images/enn.sqsh")
    assert text.startswith("#!/bin/bash\n\n# Parameters\n")
    assert "# >>> usage" not in text and "ENN_IMAGE" not in text
    assert f"--output={layout.batch_log_pattern(str(tmp_path / 'runs' / 'dry'))}" in text
    assert " --container-image=/shared/images/enn.sqsh " in text
    assert list(tmp_path.iterdir()) == [tmp_path / "run.yaml"]


def test_render_needs_no_slurm_and_submit_says_where_to_run(tmp_path):
    """With no srun, sbatch or scontrol on PATH, render prints the script it prints where
    Slurm cannot be asked (CPUs per task not sized from the nodes, one warning line says so); train
    --cluster slurm refuses in one line (exit 2) and leaves no run behind."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "noslurm"))
    bare = cli("render", cfg, *FLAGS, env={"PATH": "/nonexistent"})
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == _render(cfg, env={"SLURM_CONF": "/nonexistent"})
    (warning,) = bare.stderr.strip().splitlines()
    assert "CPUs per task not sized from the nodes (no scontrol here" in warning, warning
    # the range's one task per node holds its 2 tasks' one CPU each (no more is known)
    assert "#SBATCH --cpus-per-task=2" in bare.stdout
    assert "#SBATCH --ntasks-per-node" not in bare.stdout
    res = cli("train", "--config", cfg, "--cluster", "slurm", *FLAGS,
              env={"PATH": "/nonexistent"})
    assert res.returncode == 2 and "this machine has no Slurm (no sbatch on PATH)" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs" / "noslurm").exists()
