"""Issue 16 item 9: prediction's weights are built empty in the inference dtype and cast as
they are read; no rank holds an fp32 copy of the whole model but rank 0, whose fp32 read
feeds the precision check. Measured as in test_meta_init: peak RSS over the setup
(tests/peak_rss.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import enn_cluster
from enn_cluster.config.loading import config_from_dict
from enn_cluster.worker.predict_weights import empty_replica
from helpers import ROOT, cli, small_config, write_config

PROBE = r"""
import json, os, sys
from enn_cluster.worker import predict
from enn_cluster.worker.entry import run_task
from tests.peak_rss import measured

record = {}
load = measured(predict.load_replica, record, "setup_peak_mb")
def probed(*args, **kw):
    model, first_fp32 = load(*args, **kw)
    record["dtypes"] = sorted({str(t.dtype) for t in model.state_dict().values()})
    record["fp32_rerun"] = first_fp32 is not None
    return model, first_fp32
predict.load_replica = probed
code = run_task(sys.argv[1], "predict", sys.argv[2])
with open(os.path.join(sys.argv[3], f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"code": code, **record}, fh)
os._exit(code)  # as the worker leaves (worker.exit_now)
"""

WIDTH, LAYERS = 2048, 8  # 128 MiB of fp32 parameters, 16 MiB a layer
MANIFEST = {"entries": {"train_y": {"shape": [10, 3]}}}


def test_no_rank_holds_fp32_weights_beyond_rank_0s_read(tmp_path):
    """2 nodes x 2 ranks predicting in bf16: rank 0 reads fp32 (its precision check), rank
    2 reads for node 1 straight into bf16, ranks 1 and 3 receive bf16."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "big", model={"name": "mlp", "hidden_sizes": [WIDTH] * (LAYERS + 1)},
        training={"max_steps": 1, "per_device_train_batch_size": 4, "bf16": "true"},
        checkpoint={"every_steps": 1}, parallel={"nodes": 1, "procs_per_node": 2,
                                                 "strategy": "fsdp"}))
    assert cli("train", "--config", cfg, timeout=600).returncode == 0
    run = tmp_path / "runs" / "big"
    x = np.random.default_rng(3).standard_normal((64, 8)).astype(np.float32)
    from enn_cluster.client.prediction_request import prepare_prediction
    from enn_cluster.storage.rundir import RunDir

    prepare_prediction(RunDir(run), x, name="m", chunk_rows=16, batch_size=8)
    probe, out = tmp_path / "probe.py", tmp_path / "out"
    probe.write_text(PROBE)
    out.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(probe), str(run), "m", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ENN_SIM_NODES="2",
                 MALLOC_MMAP_THRESHOLD_=str(2**20)))
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    model = enn_cluster.Run.open(run).load_model()
    fp32_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    layer_mb = WIDTH * WIDTH * 4 / 2**20
    for rank, r in enumerate(ranks):
        assert r["code"] == 0 and r["dtypes"] == ["torch.bfloat16"], (rank, r)  # bf16 on load
        assert r["fp32_rerun"] == (rank == 0), (rank, r)
    # rank 0: its fp32 read (the check's weights), cast into its replica as it frees it
    assert 0.9 * fp32_mb < ranks[0]["setup_peak_mb"] < fp32_mb + 1.5 * layer_mb, ranks[0]
    for r in ranks[1:]:  # the bf16 replica, and at most one fp32 tensor as it is read
        assert 0.45 * fp32_mb < r["setup_peak_mb"] < fp32_mb / 2 + 1.5 * layer_mb < fp32_mb, r
    manifest = json.loads((run / "predictions" / "m" / "manifest.json").read_text())
    check = manifest["precision_check"]
    assert check["weights_dtype"] == "bfloat16" and check["max_abs_diff"] >= 0.0, check
    assert sum(bool(c.get("precision_check")) for c in manifest["chunks"]) == 1  # chunk 0
    assert cli("collect", run, "--name", "m", "--out", tmp_path / "y.npy").returncode == 0
    with torch.no_grad():  # the same weights rounded to bf16, batch for batch
        ref = torch.cat([model.to(torch.bfloat16)(torch.from_numpy(x[i:i + 8]).bfloat16())
                         for i in range(0, 64, 8)]).float().numpy()
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), ref, rtol=0,
                               atol=0.02 * float(np.abs(ref).max()))


def test_replica_is_built_empty_in_the_inference_dtype(tmp_path):
    """No random init: the global generator draws nothing while the replica is built."""
    cfg = config_from_dict(small_config(tmp_path, "m", model={"hidden_sizes": [32, 32]}))
    before = torch.random.get_rng_state()
    model = empty_replica(cfg, MANIFEST, (8,), torch.bfloat16, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert {t.dtype for t in model.state_dict().values()} == {torch.bfloat16}
    assert not model.training and not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("factory", ["scaled", "scaled_own_init"])
def test_buffers_no_checkpoint_restores_are_computed(tmp_path, factory):
    """A buffer outside the state dict: built whole (no init_weights) or computed again by
    the model's own init_weights; either way in the inference dtype."""
    cfg = config_from_dict(small_config(tmp_path, "m", model={
        "name": f"tests.api_models:{factory}", "hidden_sizes": []}))
    model = empty_replica(cfg, MANIFEST, (8,), torch.bfloat16, torch.device("cpu"))
    assert torch.equal(model.scale, torch.tensor([1.0, 1.5, 2.0], dtype=torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_tied_weight_model_predicts_in_bf16_with_its_fp32_check(tmp_path):
    """Rank 0's fp32 reference of chunk 0 runs the replica with fp32 weights swapped in:
    the two names of a tied weight must come with one tensor there (functional_call
    refuses two values for a tied pair), and the check is recorded."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "tied", model={"name": "tests.api_models:tied"},
        training={"max_steps": 2, "bf16": "true"}, checkpoint={"every_steps": 2},
        parallel={"nodes": 1, "procs_per_node": 2, "strategy": "fsdp"}))
    assert cli("train", "--config", cfg, timeout=600).returncode == 0
    run = tmp_path / "runs" / "tied"
    np.save(tmp_path / "x.npy", np.random.default_rng(5).standard_normal((40, 8)).astype(np.float32))
    done = cli("predict", run, "--input", tmp_path / "x.npy", "--name", "p", "--chunk-rows", "20",
               "--nodes", "1", "--procs-per-node", "2", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((run / "predictions" / "p" / "manifest.json").read_text())
    assert manifest["precision_check"]["reduced_precision"], manifest.get("precision_check")
    model = enn_cluster.Run.open(run).load_model()
    assert model.dec.weight is model.enc.weight  # tied in what the run holds, too
