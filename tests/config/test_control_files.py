"""Config paths cannot name the run's control files (a metrics file written over run.lock
lets a second resume take over a live run; over config.yaml, it corrupts the frozen config)."""
from __future__ import annotations

import pytest

from enn_cluster.config.loading import load_config
from enn_cluster.errors import UserError


@pytest.mark.parametrize("value", ["run.lock", "config.yaml", "jobs.jsonl", "metrics.png",
                                   "data/manifest.json", "checkpoints/step-1/commit.json",
                                   "requeue/123", "metrics/../run.lock", "./run.lock",
                                   "metrics/.hidden.jsonl", "metrics", "metrics/", "/tmp/m.jsonl",
                                   "metrics/a.json", "logs/x.jsonl", "metrics.jsonl/x",
                                   "metrics/a b.jsonl", "metrics/$(touch x).jsonl", ""])
def test_metrics_path_outside_metrics_dir_is_refused(value):
    with pytest.raises(UserError, match=r"^logging\.metrics_path: .*under metrics/"):
        load_config(None, [f"logging.metrics_path={value!r}" if value else
                           "logging.metrics_path=''"])


@pytest.mark.parametrize("value", ["metrics.jsonl", "metrics/train.jsonl", "metrics/a/b-1.jsonl"])
def test_metrics_path_inside_metrics_dir_is_taken(value):
    assert load_config(None, [f"logging.metrics_path={value}"]).logging.metrics_path == value
