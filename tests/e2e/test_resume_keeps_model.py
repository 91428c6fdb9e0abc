"""A resume keeps the run's model: `resume --set` that changes what the checkpoints hold is
refused by the client before the config is re-frozen, and a config changed behind the
client's back (a shared run directory, a factory whose code changed) is refused by the
workers rather than trained from scratch, which wrote over the run's committed steps."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from enn_cluster.errors import UserError
from helpers import assert_same_steps, cli, metrics, small_config, write_config


def _tree(path: Path) -> dict:
    """Every file under `path` (relative name -> sha256)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The first 16 of 24 steps on 1x2 ranks (paused there), committed at steps 8 and 16; and
    the same 24 steps run through (the reference a resume is held to)."""
    tmp = tmp_path_factory.mktemp("keeps-model")
    for name, pause in (("mlp", {"pause_at_step": 16}), ("through", {})):
        cfg = small_config(tmp, name, training={"max_steps": 24, **pause},
                           parallel={"nodes": 1, "procs_per_node": 2})
        res = cli("train", "--config", write_config(tmp / f"{name}.yaml", **cfg))
        assert res.returncode == 0, res.stderr[-3000:]
    assert len(metrics(tmp / "runs" / "mlp", "train")) == 16
    return tmp / "runs" / "mlp"


def _one_line(res, *words) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if all(w in line for w in words)]
    assert lines, res.stderr[-3000:]
    return lines[0]


def test_resume_set_that_changes_the_model_is_refused_and_writes_nothing(trained):
    before = _tree(trained)
    res = cli("resume", trained, "--nodes", "1", "--procs-per-node", "1",
              "--set", "model.hidden_sizes=[8,16]")
    line = _one_line(res, "model.hidden_sizes")
    assert res.stderr.strip() == line and "[16, 16]" in line and "new run" in line, line
    assert _tree(trained) == before  # config.yaml, its history, checkpoints, metrics


def test_a_model_changed_behind_the_clients_back_is_refused_by_the_workers(trained, tmp_path):
    """config.yaml edited in place: every committed step fails to load into the new model;
    the workers refuse (exit 2) and the checkpoints are as they were. The run then goes on
    at another world size from its newest step once the config is put back, as the run
    that went through did."""
    config = trained / "config.yaml"
    original = config.read_text()
    assert "  hidden_sizes:\n  - 16\n  - 16\n" in original
    steps = _tree(trained / "checkpoints")
    trains = len(metrics(trained, "train"))
    config.write_text(original.replace("  hidden_sizes:\n  - 16\n  - 16\n",
                                       "  hidden_sizes:\n  - 8\n  - 16\n"))
    try:
        res = cli("resume", trained, "--nodes", "1", "--procs-per-node", "1")
        line = _one_line(res, "checkpoints: no committed step of this run loads")
        assert "step-16" in line and "Size mismatch" in line, line
        assert _tree(trained / "checkpoints") == steps
        assert len(metrics(trained, "train")) == trains
    finally:
        config.write_text(original)
    res = cli("resume", trained, "--nodes", "1", "--procs-per-node", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    resume = metrics(trained, "resume")[-1]
    assert (resume["step"], resume["from_world"], resume["world_size"]) == (16, 2, 1)
    assert_same_steps(trained, trained.parent / "through", 24)


@pytest.mark.parametrize("override,allowed", [
    ("model.dropout=0.1", True), ("lora.alpha=16", True),
    ("model.name=hf:/moved/weights", True),  # an hf: model's folder may move
    ("model.name=transformer", False), ("model.n_layers=3", False), ("lora.r=8", False),
    ("lora.target_modules=[q_proj]", False), ("model.kwargs={width: 3}", False),
])
def test_which_fields_a_resume_may_change(override, allowed):
    from enn_cluster.client.prepare import resumed_config
    from enn_cluster.config.loading import config_from_dict

    base = {"model": {"name": "hf:/weights/qwen"}, "lora": {"r": 4}} \
        if override.startswith(("lora", "model.name=hf")) else {"model": {"name": "mlp"}}
    cfg = config_from_dict(base)
    if allowed:
        assert resumed_config(cfg, [override]) != cfg  # applied, not refused
    else:
        with pytest.raises(UserError, match=override.split("=")[0] + ": the run's checkpoints"):
            resumed_config(cfg, [override])
