"""A LoRA fine-tune of a Hugging Face causal LM as users run it: submitted to real Slurm,
its tasks started in our image by real Pyxis + Enroot, the weights directory mounted
read-only at its own path (issue 24), the weights saved in bf16 and trained in bf16 with
fp32 master weights (issue 36)."""
from __future__ import annotations

import json

import pytest

from helpers import cli, metrics, write_config
from lm_support import checkpoint_dtypes, lm_config, tiny_model

pytestmark = [pytest.mark.slurm, pytest.mark.podman]


def test_lora_job_runs_in_the_container_and_resumes_on_one_node(pyxis_cluster, test_image,
                                                                tmp_path):
    cluster = pyxis_cluster(1)
    model_dir = tiny_model(tmp_path, precision="bf16")  # as users' weights are: bf16, ids > 4000
    cfg = lm_config(tmp_path, model_dir, "lora-ct", training={"epochs": 1, "bf16": "true"},
                    checkpoint={"every_steps": 2})
    slurm = ("--cluster", "slurm", "--container", str(test_image), "--time", "10")
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg), *slurm,
              "--nodes", "2", "--gpus-per-node", "2", "--wait", timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    job = res.stdout.strip().splitlines()[-1]
    cluster.wait_job(job, ("COMPLETED",), timeout=60)
    run = tmp_path / "runs" / "lora-ct"
    script = next(run.rglob(f"*{job}*submission.sh"), None) or next(run.rglob("*.sh"))
    assert f"{model_dir}:{model_dir}:ro" in script.read_text()
    log = (run / "logs" / f"slurm-{job}-r0" / "rank-3.log").read_text()
    assert "worker rank 3/4" in log and "base weights" in log, log
    assert metrics(run, "train")[-1]["step"] == 8  # 64 rows / global batch 8
    record = json.loads((run / "checkpoints" / "step-8" / "commit.json").read_text())
    assert record["base_weights"]["path"] == str(model_dir)
    assert set(checkpoint_dtypes(run / "checkpoints" / "step-8").values()) == {"float32"}
    res = cli("resume", run, *slurm, "--nodes", "1", "--gpus-per-node", "2",
              "--set", "training.epochs=2", "--wait", timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["from_world"], resume["world_size"]) == (8, 4, 2)
    assert metrics(run, "train")[-1]["step"] == 16
