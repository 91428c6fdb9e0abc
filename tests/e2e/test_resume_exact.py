"""Resume anywhere is exact: the run, not the world size, owns the global batch and the
schedule. Each test stops a run (a rank dies hard after a checkpoint), resumes it at
another world size, and compares it step by step with the uninterrupted run: the same
steps, the same learning rate at every step (exact), losses within float tolerance, the
same epochs and final step, and final weights within tolerance.
"""
from __future__ import annotations

import json

import pytest

from enn_cluster.storage.dcp_metadata import load_metadata
from helpers import (
    assert_same_run,
    assert_same_steps,
    cli,
    faults,
    full_params,
    metrics,
    small_config,
    write_config,
)


@pytest.fixture
def uninterrupted(baseline):
    return baseline


def _crash_then_resume(tmp_path, first: tuple, then: tuple, between=None, checkpoint=None,
                       **training):
    """First launch at `first` (nodes, procs) with rank 1 dying at step 13; then `resume`
    at `then` (after `between(run)`, when given). Returns the run directory."""
    extra = {"checkpoint": checkpoint} if checkpoint else {}
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "moved", training=training,
        parallel={"nodes": first[0], "procs_per_node": first[1]}, **extra))
    res = cli("train", "--config", cfg, timeout=240, env=faults(fail_at_step=13, fail_rank=1))
    assert res.returncode not in (0, 2), res.stderr
    run = tmp_path / "runs" / "moved"
    if between is not None:
        between(run)
    res = cli("resume", run, "--nodes", then[0], "--procs-per-node", then[1], timeout=240)
    assert res.returncode == 0, res.stderr
    return run


@pytest.mark.parametrize("then", [(1, 2), (1, 1)], ids=["4->2", "4->1"])
def test_resume_at_a_smaller_world_matches_the_uninterrupted_run(uninterrupted, tmp_path, then):
    run = _crash_then_resume(tmp_path, (2, 2), then)
    assert_same_run(run, uninterrupted, then[0] * then[1])
    micro = {r["micro_batch"] for r in metrics(run, "resume")}
    assert micro == {8}  # per_device_train_batch_size stays the largest micro-batch


def test_a_shard_failing_its_checksum_during_the_load_falls_back_and_matches(uninterrupted,
                                                                             tmp_path):
    """Resume reads each shard once, checksumming it as it loads. The newest checkpoint's
    shard has a flipped byte in the middle of its tensor data (loaded into the model
    before the checksum ends): every rank falls back to the older step, whose load
    overwrites all of it, and the run still matches the uninterrupted one."""
    flipped = {}

    def corrupt_newest(run):
        steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
        path = run / "checkpoints" / f"step-{steps[-1]}"
        meta = load_metadata(path / ".metadata")
        big = max((d for d in meta.storage_data.values() if d.relative_path == "__1_0.distcp"),
                  key=lambda d: d.length)  # the largest tensor record: mostly its data
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[big.offset + big.length // 2] ^= 0x40
        (path / "__1_0.distcp").write_bytes(bytes(data))
        flipped.update(step=steps[-1], older=steps[-2])

    run = _crash_then_resume(tmp_path, (2, 2), (1, 2), between=corrupt_newest,
                             checkpoint={"every_steps": 4})
    assert [r["step"] for r in metrics(run, "resume")] == [flipped["older"]]
    log = "".join(p.read_text() for p in (run / "logs").rglob("rank-0.log"))
    assert f"checkpoint step-{flipped['step']} fails verification" in log
    assert "__1_0.distcp: checksum" in log
    assert_same_run(run, uninterrupted, 2)


def test_resume_at_a_larger_world_matches_the_uninterrupted_run(uninterrupted, tmp_path):
    """2 -> 4: a run first launched on 2 processes with the reference's global batch."""
    run = _crash_then_resume(tmp_path, (1, 2), (2, 2), global_batch_size=32)
    assert_same_run(run, uninterrupted, 4)
    first = metrics(run, "start")[0]
    assert (first["micro_batch"], first["accumulation"]) == (8, 2)


def test_a_world_that_cannot_split_the_batch_is_refused_before_launch(uninterrupted, tmp_path):
    """32 rows over 6 ranks: one line naming the node counts that work; nothing changes."""
    import shutil

    run = tmp_path / "base"
    shutil.copytree(uninterrupted, run)
    before = (run / "config.yaml").read_bytes()
    res = cli("resume", run, "--nodes", "3", "--procs-per-node", "2")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "training.global_batch_size" in line, line
    assert "--nodes 1, 2, 4, 8, 16" in line, line
    assert (run / "config.yaml").read_bytes() == before
    assert not (run / "config-history").exists() or not any((run / "config-history").iterdir())


def test_changing_the_global_batch_on_purpose_replans_and_is_recorded(uninterrupted, tmp_path):
    import shutil

    run = tmp_path / "base"
    shutil.copytree(uninterrupted, run)
    res = cli("resume", run, "--set", "training.global_batch_size=64",
              "--set", "training.epochs=4")
    assert res.returncode == 0, res.stderr
    resume = metrics(run, "resume")[-1]
    assert resume["global_batch_changed"] == [32, 64]
    start = metrics(run, "start")[-1]
    assert start["total_steps"] == 42 + 448 // 64  # one more epoch at the new batch
    assert metrics(run, "train")[-1]["step"] == 42 + 7


def test_out_of_memory_halves_the_micro_batch_and_the_run_matches(uninterrupted, tmp_path):
    """Issue 13 item 1: rank 1 runs out of memory at step 13 (a fault hook raises
    torch.OutOfMemoryError on CPU). The OOM governor records it; the retry resumes from
    step 8 with micro-batch 4 x accumulation 2 instead of 8 x 1, the same global batch, and
    the run ends as the uninterrupted one did, within float tolerance."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "oom", parallel={"max_restarts": 1}))
    res = cli("train", "--config", cfg, timeout=240, env=faults(oom_at_step=13, fail_rank=1))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "oom"
    assert_same_run(run, uninterrupted, resumed_at_world=4)
    (governed,) = metrics(run, "oom_governor")
    assert (governed["micro_batch"], governed["accumulation"], governed["global_batch"]) == (4, 2, 32)
    record = json.loads((run / "oom.json").read_text())
    (event,) = record["events"]
    assert (event["step"], event["rank"], event["micro_batch"], record["micro_batch_cap"]) == \
        (13, 1, 8, 4)
    assert event["memory"]["peak_rss_mb"] > 0
    status = cli("status", run).stdout
    assert "memory:          out of memory at step 13 on rank 1 (micro-batch 8 x 1); since " \
        "then micro-batch <= 4, same global batch 32" in status, status
    code, line = _doctor_logs(run)  # recovered: a warning naming why the ranks left
    assert code == 0 and line.split()[1] == "warning", line
    assert "rank 1 exited 1" in line and "out of memory at step 13 on rank 1 (micro-batch 8 " \
        "x 1); since then micro-batch <= 4, same global batch 32 (1 event(s), oom.json)" in line
    assert f"(more: python -m json.tool {run}/oom.json)" in line


def test_out_of_memory_at_micro_batch_1_stops_with_the_figures(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "floor", training={"per_device_train_batch_size": 1},
        parallel={"nodes": 1, "procs_per_node": 1, "max_restarts": 2}))
    res = cli("train", "--config", cfg, timeout=240, env=faults(oom_at_step=2))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "out of memory at step 2 on rank 0 with micro-batch 1 (memory: device cpu, " \
        "peak_rss_mb" in res.stderr and "nothing left to halve" in res.stderr, res.stderr
    run = tmp_path / "runs" / "floor"
    assert len(metrics(run, "start")) == 1  # exit 2: never retried
    attempts = sorted(p.name for p in (run / "logs").iterdir() if p.is_dir())
    assert len(attempts) == 1 and attempts[0].endswith("-r0"), attempts  # not even started
    again = cli("resume", run, timeout=240)  # every retry stops the same way until oom.json goes
    assert again.returncode == 2 and "nothing left to halve" in again.stderr, again.stderr[-3000:]
    assert "out of memory at step 2 on rank 0 with micro-batch 1" in again.stderr
    code, line = _doctor_logs(run)  # nothing left to halve: a problem, with the figures
    assert code == 1 and line.split()[1] == "problem" and "rank 0 exited 2" in line, line
    assert "out of memory at step 2 on rank 0 (micro-batch 1 x 1) with memory device cpu, " \
        "peak_rss_mb " in line and "nothing left to halve" in line, line


def _doctor_logs(run) -> tuple[int, str]:
    """`enn-submit doctor RUN`'s exit code and its logs line."""
    done = cli("doctor", run)
    return done.returncode, next(line for line in done.stdout.splitlines()
                                 if line.startswith("logs "))


def test_a_run_paused_at_a_step_goes_on_with_its_schedule(uninterrupted, tmp_path):
    """training.pause_at_step: the first launch (2x2) ends at step 20, mid-epoch, with a
    checkpoint and exit 0, its learning rates those of the whole 42-step schedule; a plain
    `resume` on 1x2 goes on to step 42 and matches the uninterrupted run (resuming with a
    larger max_steps instead would re-plan the schedule: the LR would jump)."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "paused", training={"pause_at_step": 20}))
    res = cli("train", "--config", cfg, timeout=240)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / "paused"
    assert max(r["step"] for r in metrics(run, "train")) == 20
    assert max(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")) == 20
    logs = "".join(p.read_text() for p in (run / "logs").glob("*/rank-0.log"))
    assert "paused at step 20 of 42 (training.pause_at_step)" in logs
    doctor = cli("doctor", run, timeout=120)  # clean exits, and still not done: it says so
    (line,) = [x for x in doctor.stdout.splitlines() if x.startswith("logs ")]
    assert line.split()[1] == "warning" and f"stopped at step 20 of 42 and nothing runs it: " \
        f"enn-submit resume {run}" in line, line
    res = cli("resume", run, "--nodes", "1", "--procs-per-node", "2", timeout=240)
    assert res.returncode == 0, res.stderr
    assert_same_steps(run, uninterrupted, 42)
    mine, base = full_params(run / "checkpoints" / "step-42"), \
        full_params(uninterrupted / "checkpoints" / "step-42")
    for key in base:
        assert (mine[key] - base[key]).norm() <= 1e-2 * base[key].norm(), key
