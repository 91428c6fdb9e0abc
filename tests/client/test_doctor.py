"""`enn-submit doctor`: a healthy 2-rank run that predicted is ok on every layer (exit 0);
copies of it with one fault each (the real fault, made on disk: a flipped checkpoint byte,
a missing manifest, a changed staged array, a failed rank's exit record, an unimportable
model, a GPU rank whose NCCL fell back to sockets, a torn prediction manifest) name that
layer (exit 1 for problems, 0 for warnings). Runs that met the fault for real: a model
that branches on a tensor's value (export), one that turns the fused attention kernels off
(kernels), a NaN row and NaN targets (precision, with the newest non-finite dump), a model
that outputs a constant (predictions, the collapse verdict). The logs layer's reading of
oom.json is checked on the OOM governor's own runs (test_resume_exact), which met it."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import yaml

from enn_cluster.storage.job_record import JobRecord
from helpers import ROOT, as_gpu_ranks_on_sockets, cli, small_config, write_config

LAYERS = ["files", "data", "model", "kernels", "precision", "logs", "distributed", "checkpoints",
          "export", "predictions"]
ONE_PROC = {"nodes": 1, "procs_per_node": 1}


def _train(tmp, name, code=0, **over):
    cfg = small_config(tmp, name, training={"max_steps": 3}, checkpoint={"every_steps": 3},
                       parallel={"nodes": 1, "procs_per_node": 2})
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values)
    done = cli("train", "--config", write_config(tmp / f"{name}.yaml", **cfg), cwd=ROOT / "tests")
    assert done.returncode == code, done.stderr[-3000:]
    return tmp / "runs" / name


def _predict(tmp, run, name="p"):
    np.save(tmp / f"{name}.npy", np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32))
    done = cli("predict", run, "--input", tmp / f"{name}.npy", "--name", name, cwd=ROOT / "tests")
    assert done.returncode == 0, done.stderr[-3000:]


def _doctor(run):
    done = cli("doctor", run, cwd=ROOT / "tests")
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == LAYERS, done.stdout + done.stderr
    return done.returncode, {line.split()[0]: line for line in lines}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor")
    run = _train(tmp, "h")
    _predict(tmp, run)
    return run


@pytest.mark.parametrize("rel, content, needle", [
    ("metrics.jsonl", b"\x00\xff\x1b[2J garbage\n" * 3, "3 line(s) are not JSON records"),
    ("jobs.jsonl", b"not json\n", "jobs.jsonl"),
    ("predictions/p/request.json", b"\x00\x01", "predictions/p/request.json is not a JSON"),
    ("predictions/p/request.json", b"[1, 2]", "predictions/p/request.json is not a JSON"),
])
def test_damaged_control_files_are_a_problem_not_ok(healthy, tmp_path, rel, content, needle):
    """What status, cancel or collect refuse, doctor does not call ok."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(healthy, run, symlinks=True)
    (run / rel).write_bytes(content)
    done = cli("doctor", run, cwd=ROOT / "tests")
    line = next(line for line in done.stdout.splitlines() if line.startswith("files "))
    assert done.returncode == 1 and line.split()[1] == "problem" and needle in line, line
    assert "\x1b" not in done.stdout


def _object_dtype(run):
    path = run / "predictions/p/manifest.json"
    manifest = json.loads(path.read_text())
    manifest["chunks"][0]["dtype"] = "|O"
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, needle", [
    (lambda run: (run / "predictions/p/chunk-000000.npy").write_bytes(b"\x93NUMPY"),
     "does not match its record"),
    (_object_dtype, "holds Python objects"),
    (lambda run: ((run / "predictions/p/chunk-000000.npy").unlink(),
                  os.mkfifo(run / "predictions/p/chunk-000000.npy")), "not a regular file"),
])
def test_damaged_prediction_chunks_are_a_problem(healthy, tmp_path, damage, needle):
    """A truncated chunk, an object dtype, a FIFO in a chunk's place: collect refuses each,
    and doctor says so (without opening the FIFO)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(healthy, run, symlinks=True)
    damage(run)
    done = cli("doctor", run, cwd=ROOT / "tests", timeout=120)
    line = next(line for line in done.stdout.splitlines() if line.startswith("predictions "))
    assert done.returncode == 1 and line.split()[1] == "problem" and needle in line, line


def test_healthy_run_is_ok_on_every_layer(healthy):
    code, lines = _doctor(healthy)
    assert code == 0
    for layer, line in lines.items():
        assert line.split()[1] == "ok", line
        assert "(more: " in line
    assert "2 staged arrays match" in lines["data"]
    assert "lanes: accelerator gloo, checkpoint gloo, control gloo" in lines["distributed"]
    assert f"(more: enn-submit verify {healthy})" in lines["checkpoints"]
    assert "every rank ended cleanly" in lines["logs"]
    assert "1 committed prediction(s), none near-constant" in lines["predictions"]


def _corrupt_checkpoint(run):
    victim = next((run / "checkpoints" / "step-3").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def _change_staged_array(run):
    path = run / "data" / "train_x.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _failed_rank(run):  # in the newest attempt (the prediction's)
    from enn_cluster.storage.attempts import attempt_dirs
    from enn_cluster.storage.rundir import RunDir

    exit_record = attempt_dirs(RunDir(run))[-1] / "exit-rank-1.json"
    rec = json.loads(exit_record.read_text())
    exit_record.write_text(json.dumps(dict(rec, code=1)))


def _unimportable_model(run):
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["name"] = "no_such_module_here:factory"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def _torn_prediction_manifest(run):
    path = run / "predictions" / "p" / "manifest.json"
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize("fault, layer, level, needle, code", [
    (_corrupt_checkpoint, "checkpoints", "problem", "step-3:", 1),
    (lambda run: (run / "data" / "manifest.json").unlink(), "data", "problem",
     "data/manifest.json is missing", 1),
    (_change_staged_array, "data", "problem", "train_x.npy does not match", 1),
    (_failed_rank, "logs", "problem", "rank 1 exited 1", 1),
    (_unimportable_model, "model", "problem", "no_such_module_here", 1),
    (as_gpu_ranks_on_sockets, "distributed", "warning",
     "the site expects efa but NCCL uses socket", 0),
    (_torn_prediction_manifest, "predictions", "problem", "p: manifest.json is unreadable", 1),
])
def test_one_fault_names_its_layer(healthy, tmp_path, fault, layer, level, needle, code):
    run = tmp_path / "copy"
    shutil.copytree(healthy, run)
    fault(run)
    got, lines = _doctor(run)
    assert got == code
    assert lines[layer].split()[1] == level and needle in lines[layer], lines[layer]
    others = [line for name, line in lines.items() if name != layer and line.split()[1] == "problem"]
    assert others == [], others
    if layer == "logs":
        assert f"(more: enn-submit logs {run} --rank 1)" in lines["logs"]


def test_not_export_safe_model_is_an_export_warning(tmp_path):
    run = _train(tmp_path, "b", model={"name": "api_models:branchy"})
    code, lines = _doctor(run)
    assert code == 0
    assert lines["export"].split()[1] == "warning"
    assert "not export-safe" in lines["export"] and "x.mean() > 100.0" in lines["export"]


def test_not_a_run_directory(tmp_path):
    done = cli("doctor", tmp_path)
    assert done.returncode == 2 and "is not a run directory" in done.stderr


def test_fused_attention_turned_off_is_a_kernels_warning(tmp_path):
    """The model's module turns flash attention off when imported (tests/sdpa_off_model.py):
    the workers' reports say so, and doctor and status warn that attention runs the math
    kernel."""
    run = _train(tmp_path, "k", model={"name": "sdpa_off_model:attention"})
    code, lines = _doctor(run)
    assert code == 0
    assert lines["kernels"].split()[1] == "warning"
    assert "SDPA math, compile off" in lines["kernels"], lines["kernels"]
    assert "no fused attention kernel is enabled on cpu (flash off)" in lines["kernels"]
    assert f"(more: enn-submit status {run})" in lines["kernels"]
    others = [line for name, line in lines.items() if name != "kernels" and line.split()[1] != "ok"]
    assert others == [], others
    status = cli("status", run).stdout
    assert "warning: rank 1: SDPA: no fused attention kernel is enabled on cpu" in status, status


def _nan_rows(tmp, rows):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    y[rows] = np.nan
    np.savez(tmp / "nan.npz", x=x, y=y)
    return {"train_path": str(tmp / "nan.npz"), "eval_fraction": 0.0, "allow_nonfinite": True}


@pytest.mark.parametrize("rows, training, code, level, needle", [
    ([37], {"nonfinite_policy": "skip", "max_steps": 12}, 0, "warning",
     "fp32; 3 step(s) skipped for a non-finite loss or gradient; 3 dump(s); newest "
     "nonfinite/step-"),
    (slice(None), {"max_nonfinite_steps": 2}, 1, "problem",
     "the last loss (step 1) is nan; 2 dump(s)"),
])
def test_non_finite_steps_are_a_precision_finding_naming_the_dump(tmp_path, rows, training,
                                                                   code, level, needle):
    """Row 37 has a NaN target (one skipped step per epoch of 4, logged every 4 steps):
    a warning. Every target NaN: training stops after 2 in a row, a problem. Either way
    the line names the newest dump and `more` opens it."""
    run = _train(tmp_path, "nan", code=code, data=_nan_rows(tmp_path, rows), training=training,
                 logging={"every_steps": 4} if code == 0 else {"every_steps": 1})
    got, lines = _doctor(run)
    assert got == (1 if level == "problem" else 0)
    line = lines["precision"]
    assert line.split()[1] == level and needle in line, line
    newest = max(run.glob("nonfinite/step-*.json"), key=lambda p: int(p.stem[5:]))
    assert f"newest nonfinite/{newest.name}: rows [" in line, line
    assert f"(more: python -m json.tool {run}/nonfinite/{newest.name})" in line


def test_a_collapsed_prediction_is_a_predictions_warning_with_its_verdict(tmp_path):
    """A model that outputs a constant: the prediction manifest's verdict (model) is the
    line; `more` opens the manifest, whose candidates hold the figures."""
    run = _train(tmp_path, "const", model={"name": "api_models:constant"}, parallel=ONE_PROC)
    _predict(tmp_path, run, "c")
    got, lines = _doctor(run)
    assert got == 0
    line = lines["predictions"]
    assert line.split()[1] == "warning", line
    assert "c: collapse verdict (model): output 0: the inputs vary but every candidate" in line
    assert f"(more: python -m json.tool {run}/predictions/c/manifest.json)" in line


def test_a_save_longer_than_the_signal_grace_is_a_warning_and_raises_the_next_grace(healthy,
                                                                                    tmp_path):
    """The newest commit record says the save took 200 s; the run's Slurm job had the
    default 90 s USR2 grace: doctor and status warn with the grace to ask for, and the next
    submit without --signal-grace asks for it (capped by the time limit)."""
    from enn_cluster.client.doctor import check_checkpoints
    from enn_cluster.client.status import save_grace_line
    from enn_cluster.cluster.submit_slurm import measured_grace
    from enn_cluster.storage import commits as store
    from enn_cluster.storage.rundir import RunDir

    run = tmp_path / "run"
    shutil.copytree(healthy, run, symlinks=True)
    rd = RunDir(run)
    assert check_checkpoints(rd, "RUN").level == "ok"
    assert measured_grace(rd, 90, "4:00:00") == 90  # a CPU save fits easily
    step = store.latest_committed(rd.checkpoints)
    path = store.step_dir(rd.checkpoints, step) / store.COMMIT
    path.write_text(json.dumps({**json.loads(path.read_text()), "save_seconds": 200.0}))
    rd.record_job(JobRecord(kind="slurm", job_id="7", signal_grace_s=90))
    found = check_checkpoints(rd, "RUN")
    assert found.level == "warning" and f"step-{step} took 200 s" in found.detail
    assert "--signal-grace 330 " in found.detail
    assert save_grace_line(rd, rd.jobs()) in found.detail
    assert measured_grace(rd, 90, "4:00:00") == 330
    assert measured_grace(rd, 90, "5") == 180  # 5 minutes: the time limit less 2 minutes
    assert measured_grace(rd, 400, "4:00:00") == 400  # a site grace that already fits


@pytest.mark.parametrize("moment", ["verify_checkpoint", "verify_files"])
def test_a_step_pruned_while_doctor_reads_it_is_no_problem(tmp_path, monkeypatch, capsys,
                                                           moment):
    """issue 40: doctor on a live run. It lists the committed steps; then rank 0's real
    keep-k prune, in its own thread, removes all but the newest, before doctor reads a
    step's commit record (verify_checkpoint) or after it read it, before the files
    (verify_files). The pruned steps are skipped: no problem, exit 0."""
    import argparse
    import threading

    from enn_cluster.client import doctor
    from enn_cluster.storage import commits as store

    run = _train(tmp_path, "k", training={"max_steps": 4},
                 checkpoint={"every_steps": 1, "keep_last": 10})
    root = run / "checkpoints"
    steps = store.committed_steps(root)
    assert len(steps) >= 3, steps
    real, pruned = getattr(store, moment), []

    def prune_first(*args, **kwargs):  # the moment doctor reads its first step
        if not pruned:
            worker = threading.Thread(target=lambda: pruned.extend(store.prune(root, 1)))
            worker.start()
            worker.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(store, moment, prune_first)
    code = doctor.cmd_doctor(argparse.Namespace(run_dir=str(run)))
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("checkpoints "))
    assert pruned == steps[:-1] and store.list_steps(root) == steps[-1:]
    assert code == 0 and "problem" not in out, out
    assert line.split()[1] == "ok" and f"1 complete, all verify (newest step-{steps[-1]})" in line, line
