"""`enn-submit doctor`: a healthy 2-rank run is ok on all eight layers (exit 0); copies of it
with one fault each (the real fault, made on disk: a flipped checkpoint byte, a missing
manifest, a changed staged array, a failed rank's exit record, an unimportable model, a
GPU rank whose NCCL fell back to sockets) name that layer (exit 1 for problems, 0 for
warnings); a model that branches on a tensor's value gets an export warning."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from helpers import ROOT, cli, small_config, write_config

LAYERS = ["data", "model", "kernels", "precision", "logs", "distributed", "checkpoints",
          "export"]


def _train(tmp, name, **over):
    cfg = small_config(tmp, name, training={"max_steps": 3}, checkpoint={"every_steps": 3},
                       parallel={"nodes": 1, "procs_per_node": 2}, **over)
    done = cli("train", "--config", write_config(tmp / f"{name}.yaml", **cfg), cwd=ROOT / "tests")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs" / name


def _doctor(run):
    done = cli("doctor", run, cwd=ROOT / "tests")
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == LAYERS, done.stdout + done.stderr
    return done.returncode, {line.split()[0]: line for line in lines}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("doctor"), "h")


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


def _failed_rank(run):
    (exit_record,) = run.glob("logs/*/exit-rank-1.json")
    rec = json.loads(exit_record.read_text())
    exit_record.write_text(json.dumps(dict(rec, code=1)))


def _unimportable_model(run):
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["name"] = "no_such_module_here:factory"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def _nccl_fell_back_to_sockets(run):  # the GPU fault, written as a GPU rank would report it
    for path in run.glob("logs/*/backend-rank-*.json"):
        rep = json.loads(path.read_text())
        rep.update(device="cuda:0", device_type="cuda", nccl_version="2.23.4",
                   nccl_transport="socket", expected_fabric="efa",
                   lanes={"accelerator": "cpu:gloo,cuda:nccl", "control": "gloo",
                          "checkpoint": "gloo"})
        path.write_text(json.dumps(rep))


@pytest.mark.parametrize("fault, layer, level, needle, code", [
    (_corrupt_checkpoint, "checkpoints", "problem", "step-3:", 1),
    (lambda run: (run / "data" / "manifest.json").unlink(), "data", "problem",
     "data/manifest.json is missing", 1),
    (_change_staged_array, "data", "problem", "train_x.npy does not match", 1),
    (_failed_rank, "logs", "problem", "rank 1 exited 1", 1),
    (_unimportable_model, "model", "problem", "no_such_module_here", 1),
    (_nccl_fell_back_to_sockets, "distributed", "warning",
     "the site expects efa but NCCL uses socket", 0),
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
