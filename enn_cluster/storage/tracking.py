"""Optional MLflow tracking: one MLflow run per enn_cluster run, across every restart.

The client (CLI or API, before launching) creates the MLflow run once, records its id
in `RUN_DIR/mlflow.json` and passes it to the workers in ENN_MLFLOW_RUN_ID; rank 0 alone
logs into it. A restart, a requeue or `enn-submit resume` finds the same id, so the
MLflow run holds the whole history. Credentials (MLFLOW_TRACKING_TOKEN, ...) stay in
the environment that MLflow reads itself: they are never written to the run directory.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from enn_cluster.config.launch_env import handed_to_workers
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import RunDir, atomic_write_text

RUN_ID_VAR = "ENN_MLFLOW_RUN_ID"
RECORD = "mlflow.json"
FLUSH_EVERY = 20  # records per batch sent to the tracking server
log = logging.getLogger("enn_cluster.storage.tracking")


def tracking_uri(cfg) -> Optional[str]:
    return cfg.logging.mlflow_tracking_uri or None


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise UserError("logging.mlflow_tracking_uri: set, but mlflow is not installed; "
                        "pip install 'enn_cluster[mlflow]' or clear the setting")
    return mlflow


# MLflow's own defaults (120 s per request, 7 retries with backoff) hold a launch, and the
# run's lock, for many minutes when the server is down. These apply unless the user set them.
CLIENT_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def ensure_run(run: RunDir, cfg) -> dict[str, str]:
    """Client side, before launch: the MLflow run of this run (created on first use), as the
    environment its workers need: its id, and our request limits where the user set none.
    The caller hands them over for the launch alone (launch_env.handed_to_workers), so a
    notebook's own MLflow calls keep MLflow's defaults. Empty: no tracking."""
    uri = tracking_uri(cfg)
    if uri is None:
        return {}
    limits = {k: v for k, v in CLIENT_LIMITS.items() if k not in os.environ}
    record = run.path / RECORD
    if record.exists():
        run_id = json.loads(record.read_text())["run_id"]
    else:
        with handed_to_workers(limits):  # and to this process's own requests
            run_id, experiment_id = _create_mlflow_run(uri, cfg, run)
        atomic_write_text(record, json.dumps({"run_id": run_id, "experiment_id": experiment_id,
                                              "tracking_uri": uri}, indent=1))
    return {RUN_ID_VAR: run_id, **limits}


def _create_mlflow_run(uri: str, cfg, run: RunDir) -> tuple[str, str]:
    """Create the MLflow run, with bounded timeouts; an unreachable server is one line."""
    from urllib.parse import urlsplit

    mlflow = _mlflow()
    try:
        client = mlflow.tracking.MlflowClient(uri)
        name = cfg.logging.mlflow_experiment
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        created = client.create_run(experiment_id, run_name=cfg.run_name,
                                    tags={"enn_cluster.run_dir": str(run.path)})
    except Exception as exc:  # mlflow raises its own, requests' and OSErrors alike
        where = urlsplit(uri)
        raise UserError(f"logging.mlflow_tracking_uri: cannot use the MLflow server at "
                        f"{where.scheme}://{where.hostname or ''}"
                        f"{':%d' % where.port if where.port else ''}{where.path[:60]} "
                        f"({type(exc).__name__}); start it, check the URI, or clear the "
                        "setting") from None
    return created.info.run_id, experiment_id


class MlflowSink:
    """Rank 0's metrics, batched into the MLflow run named by the client."""

    def __init__(self, uri: str, run_id: str) -> None:
        mlflow = _mlflow()
        from mlflow.entities import Metric

        self._metric = Metric
        self.client = mlflow.tracking.MlflowClient(uri)
        self.run_id = run_id
        self.pending: list = []

    def log(self, kind: str, record: dict) -> None:
        if kind not in ("train", "eval"):
            return
        stamp = int(record["time"] * 1000)
        for key, value in record.items():
            if key in ("kind", "time", "step") or not isinstance(value, (int, float)):
                continue
            self.pending.append(self._metric(key, float(value), stamp, int(record["step"])))
        if len(self.pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as exc:  # tracking is best effort: never stop training for it
            log.warning("MLflow logging failed (%s); metrics stay in the JSONL", exc)

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        """Upload a folder (profiler traces) into the run's artifacts; best effort."""
        try:
            self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)
        except Exception as exc:  # never stop training for tracking
            log.warning("MLflow artifact upload of %s failed (%s); the files stay there",
                        local_dir, exc)

    def close(self) -> None:
        self.flush()


def worker_sink(cfg, run: RunDir, rank: int) -> Optional[MlflowSink]:
    """Rank 0 only, and only when a tracking URI is configured."""
    uri = tracking_uri(cfg)
    if uri is None or rank != 0:
        return None
    run_id = os.environ.get(RUN_ID_VAR)
    if not run_id and (run.path / RECORD).exists():
        run_id = json.loads((run.path / RECORD).read_text())["run_id"]
    if not run_id:
        log.warning("MLflow: no run id (set by the client); not logging to MLflow")
        return None
    return MlflowSink(uri, run_id)
