"""The core runtime end to end on the embedded default: real worker processes, gloo, DCP.

One baseline run (2x2 HSDP, the `baseline` fixture in conftest.py) is shared; each test starts its own processes.
"""
from __future__ import annotations

import math
import shutil

import pytest

from helpers import cli, faults, full_params, metrics, small_config, write_config


def test_baseline_trains_checkpoints_and_learns(baseline):
    train = metrics(baseline, "train")
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert len(train) == 3 * (448 // 32)  # 3 epochs of 448 train rows, global batch 8x4
    first = sum(r["loss"] for r in train[:5]) / 5
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    evals = metrics(baseline, "eval")
    assert len(evals) == 3 and all(math.isfinite(r["eval_loss"]) for r in evals)
    for key in ("lr", "samples_per_s", "step_time_s", "grad_norm", "peak_mem_mb", "epoch"):
        assert key in train[-1]
    steps = sorted(int(p.name.split("-")[1]) for p in (baseline / "checkpoints").iterdir())
    assert steps == [16, 24, 32, 40, 42]  # keep_last=5
    res = cli("verify", baseline)
    assert res.returncode == 0 and res.stdout.count("OK") == 5, res.stdout
    res = cli("status", baseline)
    assert "last complete:   step-42" in res.stdout, res.stdout


def test_rank_death_restart_resumes_to_identical_parameters(baseline, tmp_path):
    """A rank dies hard at step 13 (after the step-8 checkpoint); the elastic launcher
    restarts the group, which resumes from step 8 and ends bit-identical to the baseline."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "crash"))
    res = cli("train", "--config", cfg, "--max-restarts", "1",
              env=faults(fail_at_step=13, fail_rank=3))
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / "crash"
    assert (run / "faults" / "fired-step-13").exists()
    resumes = metrics(run, "resume")
    assert [r["step"] for r in resumes] == [8]
    attempts = sorted(p.name for p in (run / "logs").iterdir() if p.is_dir())
    assert [a.rsplit("-", 1)[1] for a in attempts] == ["r0", "r1"], attempts  # one log each
    ours, theirs = full_params(run / "checkpoints" / "step-42"), full_params(baseline / "checkpoints" / "step-42")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert (ours[key] == theirs[key]).all(), key


def test_which_exits_the_local_launcher_restarts():
    """Failures are restarted; success, a stop with a checkpoint, bad input (2, whichever rank
    refused while the agent stopped the others) and a signal to the launcher are not."""
    from enn_cluster.client.launch_local import failure_code, retried

    assert [c for c in (0, 1, 2, 75, 134, 137, 143) if retried(c)] == [1]
    assert failure_code([-15, 2, -15]) == 2 and failure_code([-9, -15]) == 1
    assert failure_code([1, 2]) == 2 and failure_code([7]) == 7 and failure_code([]) == 1


def test_the_agent_waits_for_the_checkpoint_a_stopped_worker_may_take():
    """A TERM or INT to the local launcher reaches the workers through torch's elastic
    agent, which kills them shutdown_timeout later: never before parallel.stop_grace_s,
    the time a worker may take to reach its checkpoint. Torch 2.9 has no such field (its
    agent's 30 s stand, as docs/config.md says); 2.13 has it."""
    from enn_cluster.client.launch_local import SHUTDOWN_MARGIN_S, shutdown_options

    fields = {"nproc_per_node", "rdzv_backend", "shutdown_timeout"}
    assert shutdown_options(60.0, fields) == {"shutdown_timeout": 60 + SHUTDOWN_MARGIN_S}
    assert shutdown_options(0.5, fields) == {"shutdown_timeout": 1 + SHUTDOWN_MARGIN_S}
    assert shutdown_options(60.0, fields - {"shutdown_timeout"}) == {}


def test_rank_death_without_restarts_fails_fast(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "dies"))
    res = cli("train", "--config", cfg, timeout=120, env=faults(fail_at_step=3, fail_rank=1))
    assert res.returncode != 0


def test_resume_at_smaller_world_skips_torn_and_corrupt_checkpoints(baseline, tmp_path):
    """Saved at world 4 (2x2), resumed at world 2 (1x2). The newest checkpoint has no
    commit record and the next one a corrupted shard: resume must use step-32."""
    run = tmp_path / "base"
    shutil.copytree(baseline, run)
    (run / "checkpoints" / "step-42" / "commit.json").unlink()
    shard = run / "checkpoints" / "step-40" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify = cli("verify", run)
    assert verify.returncode == 1 and "step-40: CORRUPT" in verify.stdout, verify.stdout
    assert "step-42: incomplete" in verify.stdout
    # issue 12: status never calls a checksum-corrupt step "last complete" (sizes are right)
    status = cli("status", run).stdout.splitlines()
    assert "last complete:   step-32 (checksums verified)" in status, status
    assert any(line.startswith("corrupt:         step-40: __1_0.distcp: checksum")
               and "resume skips it" in line for line in status), status
    res = cli("resume", run, "--nodes", "1", "--procs-per-node", "2",
              "--set", "training.max_steps=50")
    assert res.returncode == 0, res.stderr
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["world_size"], resume["from_world"]) == (32, 2, 4)
    after = [r for r in metrics(run, "train") if r["time"] > resume["time"]]
    assert [r["step"] for r in after] == list(range(33, 51))
    assert all(math.isfinite(r["loss"]) for r in after)
    # step-40 was written again from step 32: the corrupt attempt was set aside, never
    # written over, and pruned once the new step-40 committed (issue 37: keep-k removes it)
    logs = max((d for d in (run / "logs").iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    said = (logs / "rank-0.log").read_text()
    assert "step-40: an earlier attempt that never committed is set aside as step-40.torn-" \
        in said, said[-3000:]
    assert list((run / "checkpoints").glob("*.torn-*")) == []
    assert cli("verify", run).returncode == 0


def test_fsdp_run_resumes_under_ddp_with_async_checkpoints(tmp_path):
    """Strategies share one checkpoint format: FSDP shards load into a DDP replica."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "strat", parallel={"nodes": 1, "procs_per_node": 2, "strategy": "fsdp"},
        training={"epochs": 1}))
    assert cli("train", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "strat"
    res = cli("resume", run, "--set", "parallel.strategy=ddp", "--set", "training.epochs=2",
              "--set", "checkpoint.async_save=true")
    assert res.returncode == 0, res.stderr
    resume = metrics(run, "resume")[-1]
    assert resume["step"] == 28
    assert metrics(run, "train")[-1]["step"] == 56
    assert all(math.isfinite(r["loss"]) for r in metrics(run, "train"))
    verify = cli("verify", run)
    assert verify.returncode == 0 and "step-56: OK" in verify.stdout and "step-48: OK" in verify.stdout


def test_eval_every_steps_and_at_the_end_of_a_run_shorter_than_an_epoch(tmp_path):
    """training.eval_every_steps evaluates within an epoch, and every run ends evaluated
    (10 and 13 steps of a 14-step epoch); the loss is the mean over the eval rows of the
    checkpoint's own forward. The run's lr follows training.lr_schedule."""
    import numpy as np
    import torch

    import enn_cluster
    from enn_cluster.config.schedule import lr_at
    from enn_cluster.storage.staging import open_array, read_manifest

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "evals", parallel={"nodes": 1, "procs_per_node": 2},
        training={"max_steps": 10, "eval_every_steps": 4, "lr_schedule": "linear",
                  "min_lr_ratio": 0.5, "adam_beta2": 0.95}))
    res = cli("train", "--config", cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "evals"
    assert [(r["step"], r["epoch"]) for r in metrics(run, "eval")] == [(4, 0), (8, 0), (10, 0)]
    t = small_config(tmp_path)["training"]  # the schedule asked for, step by step
    assert [r["lr"] for r in metrics(run, "train")] == pytest.approx(
        [lr_at(s, 10, t["lr"], t["warmup_ratio"], 0.5, "linear") for s in range(10)])
    res = cli("resume", run, "--set", "training.max_steps=13")
    assert res.returncode == 0, res.stderr[-3000:]
    evals = metrics(run, "eval")
    assert [r["step"] for r in evals] == [4, 8, 10, 12, 13]
    manifest = read_manifest(run / "data")
    lo, hi = manifest["eval_rows"]
    x = torch.from_numpy(np.array(open_array(run / "data", "train_x")[lo:hi]))
    y = torch.from_numpy(np.array(open_array(run / "data", "train_y")[lo:hi]))
    model = enn_cluster.Run.open(run).load_model(13, raw=True)
    with torch.no_grad():
        expect = float(torch.nn.functional.mse_loss(model(x), y))
    assert math.isclose(evals[-1]["eval_loss"], expect, rel_tol=1e-5), (evals[-1], expect)


def test_non_finite_losses_abort_with_a_clear_message(tmp_path):
    import numpy as np

    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = np.full((64, 1), np.nan, dtype=np.float32)
    np.savez(tmp_path / "nan.npz", x=x, y=y)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "nan", data={"train_path": str(tmp_path / "nan.npz"), "eval_fraction": 0.0,
                               "allow_nonfinite": True},
        training={"max_nonfinite_steps": 3}, parallel={"nodes": 1, "procs_per_node": 1}))
    res = cli("train", "--config", cfg, timeout=120)
    assert res.returncode != 0
    assert "3 non-finite losses in a row at step 2" in res.stderr
    skipped = metrics(tmp_path / "runs" / "nan", "train")
    assert [(r["loss"], r["skipped"]) for r in skipped] == [("nan", 1), ("nan", 2)]


def test_a_nan_row_is_dumped_with_its_rows_and_parameters_and_the_policy_decides(tmp_path):
    """Row 37 of 64 has a NaN target; 2 ranks, global batch 16: one non-finite step per
    epoch. Logging every 4 steps (the dump waits for the log step, the gradients do not:
    they are counted on the device when the step runs). `skip` trains on and leaves one
    dump per epoch; `abort` stops at the first."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    y[37] = np.nan
    np.savez(tmp_path / "one_nan.npz", x=x, y=y)

    def train(name, policy):
        cfg = write_config(tmp_path / f"{name}.yaml", **small_config(
            tmp_path, name, data={"train_path": str(tmp_path / "one_nan.npz"),
                                  "eval_fraction": 0.0, "allow_nonfinite": True},
            training={"nonfinite_policy": policy, "grad_clip": 1.0},
            logging={"every_steps": 4}, parallel={"nodes": 1, "procs_per_node": 2}))
        return cli("train", "--config", cfg, timeout=180), tmp_path / "runs" / name

    res, run = train("skip", "skip")
    assert res.returncode == 0, res.stderr[-2000:]
    dumps = sorted((run / "nonfinite").glob("step-*.json"),
                   key=lambda p: int(p.stem.removeprefix("step-")))
    assert len(dumps) == 3, dumps  # 3 epochs, row 37 once in each
    for n, path in enumerate(dumps, 1):
        d = json.loads(path.read_text())
        assert 37 in d["rows"] and len(d["rows"]) == 16 and len(d["rows_by_rank"]) == 2
        assert d["loss"] != d["loss"] and d["skipped_total"] == n  # NaN loss
        assert d["step"] == int(path.stem.removeprefix("step-"))
        assert d["param_dtype"] == "float32" and d["policy"] == "skip" and d["lr"] > 0
        assert d["grad_norm"] != d["grad_norm"]  # NaN: the norm of NaN gradients, before the clip
        shards = d["nonfinite_grad_shards"]  # a NaN target reaches every gradient
        assert set(shards) == {"layers.0.0.weight", "layers.0.0.bias", "layers.1.0.weight",
                               "layers.1.0.bias", "head.weight", "head.bias"}, shards
        # 2 ranks shard each parameter; the head's one bias lives on rank 0 only
        assert shards["layers.0.0.weight"] == 2 and shards["head.bias"] == 1, shards
    status = cli("status", run)
    assert f"non-finite:      3 dump(s); newest {dumps[-1].parent.name}/{dumps[-1].name}" \
        in status.stdout, status.stdout
    assert "head.bias (1 shard)" in status.stdout, status.stdout
    assert metrics(run, "train")[-1]["skipped"] == 3

    res, run = train("abort", "abort")
    assert res.returncode != 0 and "nonfinite_policy=abort" in res.stderr, res.stderr[-2000:]
    (dump,) = (run / "nonfinite").glob("step-*.json")
    assert 37 in json.loads(dump.read_text())["rows"]
