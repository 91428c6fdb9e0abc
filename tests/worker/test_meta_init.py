"""Built on the meta device, sharded, then only the local shards materialised: no rank
ever holds the whole model, and the weights do not depend on the world size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TESTS, cli, small_config, write_config

# Installed in every worker (by the probe script under torchrun, by a sitecustomize under
# the API's own launcher); each rank writes its record to $ENN_PROBE_OUT when fit returns.
PATCHES = r"""
import json, os
import torch
from enn_cluster.worker import model_setup, trainer as tr
from tests.peak_rss import measured, rss_peak_mb

record = {}
tr.build_sharded_model = measured(model_setup.build_sharded_model, record, "build_peak_mb")

resume = tr.Trainer.resume
def resume_and_measure(self):  # the build, then the weights loaded from a checkpoint
    resume(self)
    record["load_peak_mb"] = rss_peak_mb() - record["before_mb"]
tr.Trainer.resume = resume_and_measure

fit = tr.Trainer.fit
def fit_and_count(self):
    out = fit(self)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    record["param_mb"] = sum(local(p).numel() * 4 for p in self.sm.model.parameters()) / 2**20
    record["optim_mb"] = sum(local(v).numel() * local(v).element_size()
                             for s in self.optimizer.state.values() for v in s.values()
                             if torch.is_tensor(v) and v.dim() > 0) / 2**20
    with open(os.path.join(os.environ["ENN_PROBE_OUT"], f"rank-{os.environ['RANK']}.json"),
              "w") as fh:
        json.dump(record, fh)
    return out
tr.Trainer.fit = fit_and_count
"""

PROBE = PATCHES + r"""
import sys
from enn_cluster.worker.entry import run_task
code = run_task(sys.argv[1])
record["code"] = code
with open(os.path.join(os.environ["ENN_PROBE_OUT"], f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(record, fh)
os._exit(code)  # as the worker leaves (worker.exit_now): no finalisation race with gloo threads
"""

# see tests/peak_rss.py for MALLOC_MMAP_THRESHOLD_
PROBE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}

WIDTH = 2048  # eight 2048x2048 layers: 128 MiB of fp32 parameters, 16 MiB a layer
LAYERS = 8


def test_no_rank_holds_the_whole_model(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "big", model={"name": "mlp", "hidden_sizes": [WIDTH] * (LAYERS + 1)},
        training={"max_steps": 2, "per_device_train_batch_size": 4},
        checkpoint={"every_steps": 0}, parallel={"nodes": 1, "procs_per_node": 4,
                                                 "strategy": "fsdp"}))
    assert cli("prepare", "--config", cfg).returncode == 0
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(probe), str(tmp_path / "runs" / "big")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT), ENN_PROBE_OUT=str(out), **PROBE_ENV))
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        assert r["code"] == 0
    _assert_a_share_per_rank(ranks)


def _big_mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, WIDTH),
                               *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)],
                               torch.nn.Linear(WIDTH, 1))


def _assert_a_share_per_rank(ranks: list) -> None:
    total_mb = sum(p.numel() for p in _big_mlp().parameters()) * 4 / 2**20
    layer_mb = WIDTH * WIDTH * 4 / 2**20
    for r in ranks:
        assert r["param_mb"] == pytest.approx(total_mb / 4, rel=0.05), r
        assert r["optim_mb"] == pytest.approx(2 * total_mb / 4, rel=0.05), r  # AdamW moments
        # building, then loading any checkpoint: this rank's share, plus one full layer at a
        # time (and its local slice)
        assert r["build_peak_mb"] <= r["load_peak_mb"] < total_mb / 4 + 1.5 * layer_mb \
            < total_mb / 2, (r, total_mb)


API_RUN = """
import sys
import numpy as np, torch, enn_cluster
sys.path.insert(0, sys.argv[2])
from test_meta_init import _big_mlp
x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
enn_cluster.train(_big_mlp(), x, x[:, :1] ** 2, run_dir=sys.argv[1],
                  training={"max_steps": 2, "per_device_train_batch_size": 4},
                  checkpoint={"every_steps": 0},
                  parallel={"nodes": 1, "procs_per_node": 4, "strategy": "fsdp"})
"""


def test_no_rank_holds_the_whole_model_given_to_the_api(tmp_path):
    """A module given to enn_cluster.train as an object: its structure ships without its
    weights, every rank builds it on the meta device, shards it and loads only its shards
    from the step-0 checkpoint (the client holds the whole model: it is the caller's)."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "sitecustomize.py").write_text(
        "import os\nif 'RANK' in os.environ and 'ENN_PROBE_OUT' in os.environ:\n"
        + "\n".join("    " + line for line in PATCHES.strip().splitlines()) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(
        [sys.executable, "-c", API_RUN, str(tmp_path / "runs" / "api"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ,
                 PYTHONPATH=os.pathsep.join(map(str, [tmp_path / "probe", ROOT, TESTS])),
                 ENN_PROBE_OUT=str(out), **PROBE_ENV))
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    _assert_a_share_per_rank(ranks)


def test_weights_do_not_depend_on_the_world_size(tmp_path):
    """The same run seed gives the same step-0 weights on 1, 2 (FSDP) and 4 (2x2 HSDP)
    ranks, and under DDP; a different seed gives different weights."""
    from helpers import full_params

    params = {}
    for label, par, seed in (("fsdp1", {"nodes": 1, "procs_per_node": 1, "strategy": "fsdp"}, 7),
                             ("hsdp4", {"nodes": 2, "procs_per_node": 2}, 7),
                             ("ddp2", {"nodes": 1, "procs_per_node": 2, "strategy": "ddp"}, 7),
                             ("seed8", {"nodes": 1, "procs_per_node": 1, "strategy": "fsdp"}, 8)):
        cfg = write_config(tmp_path / f"{label}.yaml", **small_config(
            tmp_path, label, model={"name": "transformer", "d_model": 16, "n_heads": 2},
            training={"max_steps": 0, "epochs": 1, "seed": seed, "lr": 1e-12},
            checkpoint={"every_steps": 1}, parallel=par))
        assert cli("train", "--config", cfg, "--set", "training.max_steps=1").returncode == 0
        params[label] = full_params(tmp_path / "runs" / label / "checkpoints" / "step-1")
    ref = params["fsdp1"]
    for label in ("hsdp4", "ddp2"):
        for key, value in ref.items():
            assert torch.allclose(params[label][key], value, atol=1e-6), (label, key)
    assert not torch.allclose(params["seed8"]["head.weight"], ref["head.weight"])


def test_a_user_factory_keeps_its_own_init_and_buffers(tmp_path):
    """A `module:factory` without init_weights is built whole, as documented: its own
    init (here a zeroed head) is kept, not replaced by the built-ins' per-module rules,
    and its BatchNorm buffers do not stop the build (the rules refused buffers)."""
    from helpers import full_params

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "own", model={"name": "api_models:normed_zero_head"},
        training={"max_steps": 1, "lr": 1e-12}, checkpoint={"every_steps": 1},
        parallel={"nodes": 1, "procs_per_node": 2, "strategy": "fsdp"}))
    res = cli("train", "--config", cfg, cwd=ROOT / "tests")  # api_models importable
    assert res.returncode == 0, res.stderr[-3000:]
    params = full_params(tmp_path / "runs" / "own" / "checkpoints" / "step-1")
    assert params["head.weight"].abs().max() < 1e-9  # lr 1e-12: the factory's zeros, kept
    assert params["body.1.running_var"].shape == (16,)


def test_a_whole_build_larger_than_the_device_is_refused(tmp_path):
    """A user factory without init_weights is built whole on every rank: on a device
    smaller than its parameters (faked here as a small GPU would report it) the worker
    refuses before building it there, in one line naming the fix, exit 2."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "whole", model={"name": "api_models:normed_zero_head"},
        training={"max_steps": 1}, checkpoint={"every_steps": 1},
        parallel={"nodes": 1, "procs_per_node": 1, "strategy": "fsdp"}))
    res = cli("train", "--config", cfg, cwd=ROOT / "tests",
              env={"ENN_FAULT_DEVICE_MEMORY_BYTES": "256"})
    assert res.returncode == 2, res.stderr[-3000:]
    assert "api_models:normed_zero_head has no init_weights()" in res.stderr
    assert "on a device of 256 bytes" in res.stderr
    assert "init_weights() method" in res.stderr and "more memory" in res.stderr
    assert not list((tmp_path / "runs" / "whole" / "checkpoints").glob("step-*"))


def test_whole_build_refusal_only_above_the_device():
    from enn_cluster.worker.model_setup import whole_build_refusal

    assert whole_build_refusal("m:f", 2**30, None) == ""  # CPU: not checked here
    assert whole_build_refusal("m:f", 2**30, 2**30) == ""
    why = whole_build_refusal("m:f", 2 * 2**30, 2**30)
    assert why.startswith("model.name: m:f has no init_weights()") and "\n" not in why
    assert "(2.0 GiB of parameters) on a device of 1.0 GiB" in why
