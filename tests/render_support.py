"""Shared by the render and run-the-script tests: paths, a hostile string, shellcheck,
the golden JobSpecs and submitit's own rendering of them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.slurm_values import WHOLE_NODE_GPUS, whole_node_request

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
TEMPLATES = ROOT / "enn_cluster" / "cluster" / "templates"
HOSTILE = "a b 'c' \"d\" $(touch CANARY1) `touch CANARY2`; touch CANARY3 & ünï ✓ $PATH \\ *"


def shellcheck(path: Path, exclude: tuple = ()) -> None:
    """`path` passes shellcheck as bash; `exclude`: codes a caller shows to be literal text
    that the script cannot annotate."""
    exe = shutil.which("shellcheck")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is missing; CI must install it (apt-get install -y shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck); CI=true makes this fail")
    skip = ["-e", ",".join(exclude)] if exclude else []
    done = subprocess.run([exe, "-s", "bash", *skip, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def golden_specs():
    return {
        "train_2x2_container": JobSpec(
            job_name="enn-demo", run_dir="/shared/runs/demo", nodes=2, gpus_per_node=2,
            time="02:00:00", partition="gpu", exclusive=True, mem_gb=0, nccl_profile="efa",
            container_image="/shared/images/enn.sqsh",
            container_mounts=("/shared/datasets:/datasets:ro",)),
        "predict_bare_metal_cpu": JobSpec(
            job_name="enn-predict", run_dir="/shared/runs/demo", task="predict",
            predict_name="holdout", gpus_per_node=0, procs_per_node=4, cpus_per_task=2,
            time=30, nccl_profile="socket", python="/opt/venv/bin/python",
            setup_lines=("module load python/3.11",)),
        "train_elastic_registry_ib": JobSpec(
            job_name="enn-big", run_dir="/shared/runs/big", nodes="2-4", gpus_per_node=8,
            time="1-00:00:00", account="ml", qos="high", mem_gb=480, nccl_profile="ib",
            container_image="nvcr.io#nvidia/pytorch:24.05-py3", container_workdir="/workspace",
            container_mounts=("/shared/datasets:/datasets:ro+rprivate", "/scratch:/scratch"),
            env={"HF_HOME": "/shared/hf cache"}, extra_sbatch_args=("--constraint=a100",),
            extra_srun_args=("--cpu-bind=none",), max_restarts=5),
        # issue 25: 4 x 8 H100 over InfiniBand, every GPU of each node: whole nodes
        "train_4x8_ib_whole_nodes": JobSpec(
            job_name="enn-8b", run_dir="/shared/runs/8b", nodes=4, gpus_per_node=8,
            time="04:00:00", partition="h100", nccl_profile="ib",
            container_image="/shared/images/enn.sqsh",
            **dict(zip(("exclusive", "mem_gb"), whole_node_request(8, WHOLE_NODE_GPUS,
                                                                   False, None)))),
    }


def make_submitit_script(spec: JobSpec, folder: str) -> str:
    """submitit 1.5.4's own rendering of our parameters, through the executor that submits."""
    from enn_cluster.cluster.submit_slurm import batch_script, slurm_executor

    return batch_script(slurm_executor(spec, folder))


def documented_cpu_only_flags() -> list[str]:
    """The sbatch flags docs/admin.md gives for CPU-only nodes (its command with
    --gpus-per-node=0): the Pyxis test submits the templates with exactly these."""
    import shlex

    text = (ROOT / "docs" / "admin.md").read_text(encoding="utf-8").replace("\\\n", " ")
    (line,) = [line for line in text.splitlines()
               if "sbatch " in line and "--gpus-per-node=0" in line and line.strip().startswith("ENN_")]
    words = shlex.split(line)
    return [w for w in words[words.index("sbatch") + 1:] if w.startswith("--")]
