"""`--nodes MIN-MAX` on Slurm: every count Slurm may grant must split the run's frozen
global batch, or a requeue onto that count would fail at start; `enn-submit` refuses the
range before sbatch, in one line naming the field and the counts that work."""
from __future__ import annotations

import os
from pathlib import Path

from helpers import cli, controller_up_scontrol, small_config, write_config

SLURM = ("--cluster", "slurm", "--container", "none", "--time", "10", "--gpus-per-node", "0",
         "--procs-per-node", "2")


def _spy_sbatch(tmp_path, says: str = "echo 'sbatch: error: spy' >&2") -> tuple[dict, Path]:
    """An sbatch first on PATH that only records that it ran: a refusal that came after
    submitting would leave its mark (and no real Slurm is needed)."""
    bin_dir, mark = tmp_path / "bin", tmp_path / "sbatch-ran"
    bin_dir.mkdir()
    spy = bin_dir / "sbatch"
    spy.write_text(f"#!/bin/sh\necho \"$@\" >> {mark}\n{says}\nexit 1\n")
    spy.chmod(0o755)
    controller_up_scontrol(bin_dir)
    site = tmp_path / "site.yaml"
    site.write_text("python: python3\n")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "ENN_SITE_CONFIG": str(site)}, mark


def _refused(res, global_batch: int, ranks: int) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    line = lines[0]
    assert "training.global_batch_size" in line, line
    assert f"global batch of {global_batch} rows does not split over {ranks} " in line, line
    return line


def test_train_range_with_a_count_that_cannot_split_is_refused_before_sbatch(tmp_path):
    """Frozen at the most nodes (4 x 2 procs x 8 rows = 64): 3 nodes (6 ranks) cannot
    take it, so --nodes 2-4 is refused and no run directory is left behind."""
    env, mark = _spy_sbatch(tmp_path)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "span"))
    res = cli("train", "--config", cfg, *SLURM, "--nodes", "2-4", env=env, cwd=tmp_path,
              timeout=120)
    line = _refused(res, 64, 6)
    assert "--nodes 1, 2, 4, 8, 16, 32 at --procs-per-node 2" in line, line
    assert not mark.exists()
    assert not (tmp_path / "runs" / "span").exists()
    ok = cli("render", cfg, "--nodes", "2", "--procs-per-node", "2", "--gpus-per-node", "0",
             "--container", "none", "--time", "10", env=env, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr  # the same config at a count that works renders


def test_resume_range_with_a_count_that_cannot_split_is_refused_before_sbatch(tmp_path):
    """A run prepared at 1 node x 2 procs has a global batch of 16: resuming on 1-3 nodes
    could be granted 3 (6 ranks), so it is refused; its config and jobs stay as they were."""
    env, mark = _spy_sbatch(tmp_path)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "grown"))
    made = cli("prepare", "--config", cfg, "--nodes", "1", "--procs-per-node", "2",
               cwd=tmp_path, timeout=120)
    assert made.returncode == 0, made.stderr
    run = tmp_path / "runs" / "grown"
    before = (run / "config.yaml").read_bytes()
    res = cli("resume", run, *SLURM, "--nodes", "1-3", env=env, cwd=tmp_path, timeout=120)
    line = _refused(res, 16, 6)
    assert "--nodes 1, 2, 4, 8 at --procs-per-node 2" in line, line
    assert not mark.exists()
    assert (run / "config.yaml").read_bytes() == before
    assert not (run / "jobs.jsonl").exists() and not (run / "run.lock").exists()
    fits = cli("resume", run, *SLURM, "--nodes", "1-2", env=env, cwd=tmp_path, timeout=120)
    assert mark.exists(), fits.stderr  # a range that splits goes on to sbatch (the spy's)
    assert fits.returncode == 2 and "sbatch refused the job: sbatch: error: spy" in fits.stderr


def test_an_sbatch_that_fails_without_a_word_is_one_line(tmp_path):
    """A failing sbatch that prints nothing (a site wrapper) is still one line, exit 2."""
    env, mark = _spy_sbatch(tmp_path, says=":")
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "mute"))
    res = cli("train", "--config", cfg, *SLURM, "--nodes", "1", env=env, cwd=tmp_path,
              timeout=120)
    assert mark.exists() and res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.endswith("sbatch refused the job: no message"), res.stderr


def test_the_counts_that_split_the_batch_are_said_in_the_api_s_words():
    """The refusal's fix names `cluster["nodes"]` and the procs per node with its value
    from the API, the flags from the CLI."""
    import pytest

    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.config.schedule import plan_batch
    from enn_cluster.errors import UserError

    cfg = config_from_dict({"training": {"global_batch_size": 6}})
    with pytest.raises(UserError) as caught:
        plan_batch(cfg.training, 4, procs_per_node=2)
    cli_line, api = str(caught.value), caught.value.rendered("api")
    assert "launch with --nodes 1, 3 at --procs-per-node 2" in cli_line, cli_line
    assert 'launch with cluster["nodes"] one of 1, 3 and cluster["procs_per_node"]=2' in api
    assert "training={'global_batch_size': N}" in api and "--" not in api, api
