"""The Python API drives the same runtime as the CLI: real workers, real files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import enn_cluster
from enn_cluster.errors import UserError
from enn_cluster.storage import commits as store
from api_models import normed_preset, preset
from helpers import TESTS, full_params


def _data(n=384, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, np.tanh(x[:, :2].sum(1, keepdims=True)).astype(np.float32)


def test_train_from_preset_weights_and_load_model(tmp_path):
    model = preset()
    x, y = _data()
    run = enn_cluster.train(model, x, y, run_dir=str(tmp_path / "runs" / "api"),
                            training={"epochs": 2, "per_device_train_batch_size": 16},
                            checkpoint={"every_steps": 0}, parallel={"nodes": 1, "procs_per_node": 2})
    step0 = full_params(run.path / "checkpoints" / "step-0")
    for key, value in model.state_dict().items():
        assert torch.equal(step0[key], value), key  # the caller's weights, exactly
    assert run.latest_checkpoint == 24  # 384 rows / (16 x 2 ranks) x 2 epochs
    for step in (0, 24):  # each commit record vouches for every file of its step
        path = store.step_dir(run.path / "checkpoints", step)
        assert sorted(store.read_commit(path)["files"]) == store.step_files(path), step
        assert store.verify_checkpoint(path) == [], step
    trained = run.load_model()
    final = full_params(run.path / "checkpoints" / "step-24")
    for key, value in trained.state_dict().items():
        assert torch.equal(value, final[key]), key
    assert not torch.equal(trained.state_dict()["head.weight"], model.state_dict()["head.weight"])
    assert [(r["step"], r.get("initial_weights")) for r in run.metrics("resume")] == [(0, True)]
    from enn_cluster.client.status import run_status
    from enn_cluster.client.status_text import format_status

    assert "restarts:        0 resume(s), 1 launch(es)" in format_status(run_status(run.path))
    again = enn_cluster.Run.open(run.path)
    assert again.latest_checkpoint == 24 and len(again.metrics("train")) == 24


def test_a_module_ships_as_its_structure_and_trains_as_a_whole_one_did(tmp_path):
    """The API ships a module without its weights (the step-0 checkpoint holds them, the
    ranks load their shards from it); BatchNorm's running statistics and a non-persistent
    buffer survive exactly, and training gives what shipping the whole module gave: the
    reference is the CLI training the same module pickled whole, through the factory
    runs made before structures were shipped still name."""
    import pickle

    from enn_cluster.storage.model_structure import read_structure, write_structure
    from helpers import cli, metrics, write_config

    model = normed_preset()
    x, y = _data()
    sections = {"training": {"epochs": 2, "per_device_train_batch_size": 16, "seed": 5},
                "checkpoint": {"every_steps": 0}, "parallel": {"nodes": 1, "procs_per_node": 2}}
    run = enn_cluster.train(model, x, y, run_dir=str(tmp_path / "runs" / "api"), **sections)
    shipped = read_structure(run.path / "model.pkl")
    assert all(t.is_meta for t in shipped.state_dict().values())
    assert torch.equal(shipped.input_scale, model.input_scale)
    step0 = full_params(run.path / "checkpoints" / "step-0")
    assert sorted(step0) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(step0[key], value), key  # running statistics included

    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    write_structure(tmp_path / "whole.pkl", pickle.dumps(model))  # with its commit record
    cfg = write_config(tmp_path / "ref.yaml", run_name="ref", runs_root=str(tmp_path / "runs"),
                       model={"name": "enn_cluster.client.api:unpickled_model",
                              "kwargs": {"path": str(tmp_path / "whole.pkl")}},
                       data={"train_path": str(tmp_path / "x.npy"),
                             "train_targets_path": str(tmp_path / "y.npy")}, **sections)
    done = cli("train", "--config", cfg, cwd=TESTS)  # imports api_models
    assert done.returncode == 0, done.stderr[-3000:]
    ref = tmp_path / "runs" / "ref"
    assert [r["loss"] for r in metrics(ref, "train")] == [r["loss"] for r in run.metrics("train")]
    final, reference = full_params(run.path / "checkpoints" / "step-24"), \
        full_params(ref / "checkpoints" / "step-24")
    for key, value in reference.items():
        assert torch.equal(final[key], value), key
    assert reference["body.1.num_batches_tracked"].item() == 5 + 24
    trained = run.load_model()
    assert torch.equal(trained.input_scale, model.input_scale)
    with torch.no_grad():
        expected = trained(torch.from_numpy(x[:40])).numpy()
    assert np.allclose(enn_cluster.predict(run, x[:40]), expected, atol=1e-5)


def test_a_structure_run_without_a_checkpoint_that_verifies_refuses_to_train(tmp_path):
    """Its weights exist only in its checkpoints: when none verifies, the workers stop with
    one line (exit 2, never retried) instead of training uninitialised storage."""
    from helpers import cli

    x, y = _data(64)
    run = enn_cluster.train(preset(), x, y, run_dir=str(tmp_path / "runs" / "gone"),
                            training={"max_steps": 1}, parallel={"nodes": 1, "procs_per_node": 2})
    import shutil

    shutil.rmtree(store.step_dir(run.path / "checkpoints", 1))
    shard = next((run.path / "checkpoints" / "step-0").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    res = cli("resume", run.path, "--set", "training.max_steps=2", "--procs-per-node", "2",
              cwd=TESTS)  # imports api_models
    assert res.returncode == 2, res.stderr[-3000:]
    assert "the model's weights exist only there" in res.stderr
    assert store.committed_steps(run.path / "checkpoints") == [0]


def test_failing_worker_is_restarted_and_run_completes(tmp_path, monkeypatch):
    x, y = _data()
    monkeypatch.setenv("ENN_TEST_FAULTS", "fail_at_step=7,fail_rank=1")  # workers inherit it
    run = enn_cluster.train("api_models:tiny", x, y, run_dir=str(tmp_path / "r"),
                            training={"epochs": 1, "per_device_train_batch_size": 16},
                            checkpoint={"every_steps": 5},
                            parallel={"nodes": 1, "procs_per_node": 2, "max_restarts": 1})
    assert (run.path / "faults" / "fired-step-7").exists()
    assert [r["step"] for r in run.metrics("resume")] == [5]
    assert run.latest_checkpoint == 12


def _local_model():
    class Local(torch.nn.Module):  # defined in a function: workers cannot import it
        def forward(self, x):
            return x
    return Local()


@pytest.mark.parametrize("model, needle", [
    (_local_model(), "defined in __main__, a notebook or a function"),
    (torch.nn.Sequential(torch.nn.Linear(2, 1)), None),
    ("no_colon_here", "is not 'package.module:factory'"),
    (42, "expected an nn.Module"),
])
def test_unshippable_models_fail_fast_without_a_run_dir(tmp_path, model, needle):
    from enn_cluster.client.api import check_shippable

    if needle is None:
        check_shippable(model)  # torch's own classes ship fine
        return
    with pytest.raises(UserError, match=needle):
        enn_cluster.train(model, *_data(), run_dir=str(tmp_path / "runs" / "x"))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("x, needle", [
    ([[0.0, 1.0], [2.0]] * 8, "rows differ in length"),  # once taken for a path
    (np.zeros((16, 0, 3), np.float32), "a row with no values"),  # once crashed the workers
    (np.zeros((16, 4, 0), np.float32), "a row with no values"),
    ({"x": 1}, "neither an array nor a path"),
])
def test_arrays_that_are_not_rows_of_features_are_refused_before_a_run(tmp_path, x, needle):
    y = np.zeros((16, 1), np.float32)
    with pytest.raises(UserError, match=needle):
        enn_cluster.train(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 1)), x, y,
                          run_dir=str(tmp_path / "runs" / "x"))
    assert not (tmp_path / "runs" / "x").exists()


def test_main_module_class_is_refused():
    from enn_cluster.client.api import check_shippable

    cls = type("Notebook", (torch.nn.Module,), {"forward": lambda self, x: x, "__module__": "__main__"})
    with pytest.raises(UserError, match="defined in __main__"):
        check_shippable(cls())


PLAIN_SCRIPT = """
import numpy as np, torch, enn_cluster
x = np.random.default_rng(0).standard_normal((256, 8)).astype(np.float32)
y = x[:, :1] ** 2
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
run = enn_cluster.train(model, x, y, run_dir=RUN_DIR, training={"epochs": 1},
                        parallel={"nodes": 1, "procs_per_node": 2})
pred = enn_cluster.predict(run, x[:40])
print("RESULT", run.latest_checkpoint, pred.shape)
"""


@pytest.mark.parametrize("how", ["script", "-c"])
def test_api_works_from_a_plain_script_without_a_main_guard(tmp_path, how):
    """Workers are fresh `python -m enn_cluster.worker` processes: the caller's script
    (no `if __name__ == "__main__":`) runs once, not once per worker."""
    import subprocess
    import sys

    from helpers import ROOT

    code = f"RUN_DIR = {str(tmp_path / 'runs' / 'plain')!r}\n" + PLAIN_SCRIPT
    script = tmp_path / "plain.py"
    script.write_text(code)
    argv = [sys.executable, str(script)] if how == "script" else [sys.executable, "-c", code]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("RESULT") == 1 and "RESULT 4 (40, 1)" in res.stdout, res.stdout


def test_api_works_from_a_notebook_kernel(tmp_path):
    """The same script as a notebook cell, in a real Jupyter kernel (ipykernel over ZeroMQ,
    as Jupyter and VS Code run it): `__main__` is the kernel's, with no file to re-run."""
    import os
    import sys

    from jupyter_client.manager import KernelManager

    from helpers import ROOT

    cell = f"RUN_DIR = {str(tmp_path / 'runs' / 'notebook')!r}\n" + PLAIN_SCRIPT
    km = KernelManager(kernel_name="python3")
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    km.start_kernel(cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(ROOT)})
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        out: list[str] = []
        reply = client.execute_interactive(
            cell, timeout=300, output_hook=lambda msg: out.append(
                msg["content"].get("text", "") + "".join(msg["content"].get("traceback", []))))
        text = "".join(out)
        assert reply["content"]["status"] == "ok", text[-3000:]
        assert text.count("RESULT") == 1 and "RESULT 4 (40, 1)" in text, text[-3000:]
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def test_load_model_before_any_checkpoint_is_a_user_error(tmp_path):
    """A prepared run that has not committed a step: one line saying so, not a traceback
    of FileNotFoundError from the checkpoint folder."""
    from helpers import cli, small_config, write_config

    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "early"))
    assert cli("prepare", "--config", cfg).returncode == 0
    with pytest.raises(UserError, match="no complete checkpoint yet"):
        enn_cluster.Run.open(tmp_path / "runs" / "early").load_model()
