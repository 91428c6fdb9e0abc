"""MLflow (optional extra): rank 0 logs into one MLflow run across a crash-restart and a
later `enn-submit resume`; the token stays in the environment. A local file store stands
in for a tracking server (MLFLOW_ALLOW_FILE_STORE: MLflow 3 keeps it for such uses)."""
from __future__ import annotations

import json

import pytest

from helpers import cli, faults, metrics, small_config, write_config

mlflow = pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
TOKEN = "tok-9f3e1c-never-on-disk"


def test_one_mlflow_run_across_restart_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = f"file://{tmp_path / 'mlruns'}"
    cfg = small_config(tmp_path, "tracked", training={"max_steps": 30},
                       checkpoint={"every_steps": 10},
                       parallel={"nodes": 1, "procs_per_node": 2, "max_restarts": 1},
                       logging={"mlflow_tracking_uri": store, "mlflow_experiment": "enn-test"},
                       profiling={"steps": "3-4"})  # issue 13 item 8: traces, as artifacts
    env = {"MLFLOW_TRACKING_TOKEN": TOKEN, **faults(fail_at_step=17)}
    done = cli("train", "--config", write_config(tmp_path / "c.yaml", **cfg), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tracked"
    run_id = json.loads((run / "mlflow.json").read_text())["run_id"]
    again = cli("resume", run, "--set", "training.max_steps=40", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / "mlflow.json").read_text())["run_id"] == run_id

    client = mlflow.tracking.MlflowClient(store)
    experiment = client.get_experiment_by_name("enn-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one MLflow run for the whole history
    loss_steps = {m.step for m in client.get_metric_history(run_id, "loss")}
    assert loss_steps == set(range(1, 41))  # before the crash, after it, and after resume
    assert {m.step for m in client.get_metric_history(run_id, "eval_loss")}
    traces = sorted((run / "profiles" / "steps-3-4").glob("rank-*.json"))
    assert [t.name for t in traces] == ["rank-0.json", "rank-1.json"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("aten::" in str(e.get("name")) for e in events), trace
    assert [r["step"] for r in metrics(run, "profile")] == [4]
    uploaded = [a.path for a in client.list_artifacts(run_id, "profiles/steps-3-4")]
    assert uploaded == ["profiles/steps-3-4/rank-0.json", "profiles/steps-3-4/rank-1.json"]
    for path in list(run.rglob("*")) + list((tmp_path / "mlruns").rglob("*")):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_credentials_in_the_uri_are_refused(tmp_path):
    cfg = small_config(tmp_path, "leaky",
                       logging={"mlflow_tracking_uri": "https://bob:hunter2@mlflow.example"})
    done = cli("train", "--config", write_config(tmp_path / "c.yaml", **cfg))
    assert done.returncode == 2 and "MLFLOW_TRACKING_TOKEN" in done.stderr
    assert "hunter2" not in done.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("uri", ["https://{t}@mlflow.example", "https://mlflow.example/?token={t}",
                                 "https://mlflow.example/x?access_token={t}",
                                 "s3://bucket/x.npz?X-Amz-Signature={t}"])
def test_token_in_a_uri_is_refused_and_never_echoed(tmp_path, uri):
    cfg = small_config(tmp_path, "leaky", logging={"mlflow_tracking_uri": uri.format(t=TOKEN)})
    done = cli("train", "--config", write_config(tmp_path / "c.yaml", **cfg))
    assert done.returncode == 2 and "logging.mlflow_tracking_uri" in done.stderr
    assert TOKEN not in done.stderr and not (tmp_path / "runs").exists()
    assert done.stderr.strip().count("\n") == 0


def test_unreachable_server_is_one_line_and_the_lock_is_released(tmp_path):
    """A server that accepts connections and never answers: the client gives up within
    MLflow's request timeout (2 s here; 10 s by default instead of 120) and few retries."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the backlog; nothing ever answers
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = small_config(tmp_path, "dark", parallel={"nodes": 1, "procs_per_node": 1},
                           logging={"mlflow_tracking_uri": uri})
        done = cli("train", "--config", write_config(tmp_path / "c.yaml", **cfg),
                   env={"MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr  # before it, train names the run directory it made
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"enn-submit: error: logging.mlflow_tracking_uri: cannot use the MLflow server at {uri}")
    assert not (tmp_path / "runs" / "dark" / "run.lock").exists()


def test_a_notebook_that_trains_two_tracked_runs_keeps_its_environment(tmp_path, monkeypatch):
    """The API launches from the caller's own process: each run's workers log into that
    run's MLflow run, and the caller's environment is as it was (no run id left for the next
    launch; its own MLflow calls keep their own request limits)."""
    import os

    import numpy as np

    import enn_cluster

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the user's own
    store = f"file://{tmp_path / 'mlruns'}"
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    y = x[:, :1].copy()
    def environ():  # but for MLflow's own bookkeeping in the process that imported it
        return {k: v for k, v in os.environ.items() if not k.startswith("_MLFLOW_")}

    before, ids = environ(), {}
    for name in ("a", "b"):
        run = enn_cluster.train("api_models:tiny", x, y, run_dir=str(tmp_path / name),
                                training={"max_steps": 3, "per_device_train_batch_size": 8},
                                checkpoint={"every_steps": 0},
                                parallel={"nodes": 1, "procs_per_node": 1},
                                logging={"mlflow_tracking_uri": store,
                                         "mlflow_experiment": "notebook"})
        assert environ() == before, set(environ().items()) ^ set(before.items())
        ids[name] = json.loads((run.path / "mlflow.json").read_text())["run_id"]
    assert ids["a"] != ids["b"]
    client = mlflow.tracking.MlflowClient(store)
    for run_id in ids.values():
        assert {m.step for m in client.get_metric_history(run_id, "loss")} == {1, 2, 3}
