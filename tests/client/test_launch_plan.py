"""One launch plan (issue 26 sections 1 and 5): config + flags + site become the shape, the
mesh at every node count, the run's batch and the Slurm job in one function, and the flags
are applied before anything that needs the world size is checked."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, cli, small_config, write_config


def test_nodes_flag_fixes_a_mesh_the_config_alone_cannot_hold(tmp_path):
    """A config that does not name parallel.nodes (so 1 x 2 ranks) with replicate=2: the
    mesh is checked against --nodes 2 x --procs-per-node 2, not the config's own 1 x 2."""
    data = small_config(tmp_path, "meshed")
    del data["parallel"]
    path = write_config(tmp_path / "run.yaml", **data)
    res = cli("prepare", "--config", path, "--set", "parallel.replicate=2", "--nodes", "2",
              "--procs-per-node", "2", "--gpus-per-node", "0", timeout=120)
    assert res.returncode == 0, res.stderr
    frozen = yaml.safe_load((Path(res.stdout.strip()) / "config.yaml").read_text())
    assert frozen["parallel"]["nodes"] == 2 and frozen["parallel"]["procs_per_node"] == 2
    assert frozen["parallel"]["replicate"] == 2
    # the world the flags give still has to hold the mesh: one line, nothing written
    res = cli("prepare", "--config", path, "--set", "run_name=other", "--set",
              "parallel.replicate=2", "--nodes", "3", "--gpus-per-node", "0", timeout=120)
    assert res.returncode == 2 and "2 x 2 does not equal the world size 6" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs" / "other").exists()


def _no_gpu_plan(*, nodes=4, gpus=8, procs=None, cpus=2, sbatch=False):
    from enn_cluster.client.launch_plan import Machine, plan_launch
    from enn_cluster.config.launch_shape import ShapeRequest
    from enn_cluster.config.loading import config_from_dict

    return plan_launch(config_from_dict({}), ShapeRequest(nodes, gpus, procs),
                       machine=Machine(cpus=cpus, gpus=0, sbatch=sbatch))


def test_gpus_asked_of_a_machine_without_them_get_one_rule():
    """Issue 26 section 5: the headline `--nodes 4 --gpus-per-node 8` on a 2-CPU machine
    without GPU or Slurm is refused whatever --procs-per-node says (1, 2 and 8 alike, where
    8 used to start 32 processes), naming this machine's lack and the forms that work."""
    import pytest

    from enn_cluster.errors import UserError

    for procs in (None, 1, 2, 8):
        with pytest.raises(UserError) as caught:
            _no_gpu_plan(procs=procs)
        text = str(caught.value)
        assert "this machine has no GPU and no Slurm" in text, text
        assert "--gpus-per-node 0 --procs-per-node 2" in text and "--cluster slurm" in text
    with pytest.raises(UserError, match="has no GPU;"):  # sbatch here: Slurm is not lacking
        _no_gpu_plan(sbatch=True)
    # what fits the machine runs on its CPU, with one warning that says so
    plan = _no_gpu_plan(nodes=1, gpus=8)
    assert plan.shape.world == 8 and plan.shape.gpus_per_node == 8
    assert len(plan.warnings) == 1 and "no GPU; the 8 local ranks run on the CPU" in plan.warnings[0]
    assert _no_gpu_plan(nodes=1, gpus=0, procs=2).warnings == ()
    # a CPU run that names its processes still means it, as before
    assert _no_gpu_plan(nodes=4, gpus=0, procs=8).shape.world == 32


def test_the_headline_command_here_exits_2_naming_what_works(tmp_path):
    """As a new user types it, on a machine without GPUs and (PATH without sbatch) Slurm."""
    import os

    import pytest

    from enn_cluster.client.launch_plan import Machine

    if Machine.here().gpus:
        pytest.skip("this machine has a GPU")
    nodes = 4 if Machine.here().process_cap < 32 else 64
    res = cli("train", "--config", ROOT / "examples" / "demo.yaml", "--nodes", nodes,
              "--gpus-per-node", "8", "--runs-root", tmp_path / "runs", timeout=120,
              env={"PATH": os.path.dirname(sys.executable)})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "this machine has no GPU and no Slurm" in lines[0], lines
    assert "--gpus-per-node 0 --procs-per-node 2" in lines[0] and "--cluster slurm" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_cpu_run_asked_for_gpus_warns_and_records_them(tmp_path):
    """`--nodes 1 --gpus-per-node 2` here: the ranks run on the CPU; the client says so once,
    the backend report records the 2 GPUs asked, and doctor says what it found."""
    from enn_cluster.client.launch_plan import Machine

    if Machine.here().gpus:
        pytest.skip("this machine has a GPU")
    path = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "cpu", training={"max_steps": 2}, data={"synthetic": {"n_samples": 64,
                                                                         "n_features": 8}}))
    res = cli("train", "--config", path, "--nodes", "1", "--gpus-per-node", "2", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    warned = [line for line in res.stderr.splitlines() if "warning:" in line]
    assert len(warned) == 1 and "no GPU; the 2 local ranks run on the CPU" in warned[0], warned
    run = tmp_path / "runs" / "cpu"
    reports = [json.loads(p.read_text()) for p in run.glob("logs/**/backend-*.json")]
    assert reports and all(r["gpus_requested"] == 2 and r["device_type"] == "cpu"
                           for r in reports), reports
    doctor = cli("doctor", run, timeout=120)
    assert "2 GPUs per node were requested but" in doctor.stdout, doctor.stdout


def test_the_slurm_job_takes_its_nodes_from_the_launch_shape(tmp_path):
    """Issue 41 section 2: the shape (config/launch_shape.py) is the one node range; the
    job built for a plan asks Slurm for that range and reads the same shape back."""
    from enn_cluster.client.launch_plan import plan_launch
    from enn_cluster.cluster.job_spec import JobSpec
    from enn_cluster.cluster.site import SiteConfig
    from enn_cluster.cluster.submit_slurm import SlurmRequest
    from enn_cluster.config.launch_shape import LaunchShape, ShapeRequest
    from enn_cluster.config.loading import config_from_dict

    cfg = config_from_dict(small_config(tmp_path, "ranged"))
    slurm = SlurmRequest({"container": "none"}, site_config=SiteConfig())
    for asked, nodes in (("2-3", "2-3"), (2, 2), ("3-3", 3), (None, cfg.parallel.nodes)):
        plan = plan_launch(cfg, ShapeRequest(asked, 4), slurm=slurm,
                           run_dir=tmp_path / "runs" / "ranged")
        assert isinstance(plan.spec, JobSpec) and plan.spec.nodes == nodes
        assert plan.spec.shape == plan.shape and plan.spec.tasks_per_node == 4
    assert LaunchShape(2, 4, 4, 3).node_counts == (2, 3) and LaunchShape(2, 1).max_nodes == 2
