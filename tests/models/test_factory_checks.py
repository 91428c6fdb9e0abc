"""A user's `module:factory` is checked by the client, on CPU runs as on GPU runs, before
anything is written: what it returns (built on the meta device) and the keywords it takes
(model.kwargs against its signature) are one line, exit 2, where they were a traceback on
every rank. A factory that cannot build on the meta device (one calling from_pretrained) is
valid: it prepares and trains (its workers build it whole); only `plan` cannot size it."""
from __future__ import annotations

import pytest

from helpers import ROOT, cli, refused, small_config, write_config

SHAPES = {"cpu": ("--gpus-per-node", "0", "--procs-per-node", "2"),
          "gpu": ("--gpus-per-node", "2")}


def _prepare(tmp_path, model: dict, shape: str, command: str = "prepare"):
    tmp_path.mkdir(exist_ok=True)
    cfg = small_config(tmp_path, "fac", model=model, training={"max_steps": 1},
                       parallel={"nodes": 1, "procs_per_node": 1})
    path = write_config(tmp_path / "run.yaml", **cfg)
    return cli(command, "--config", path, "--nodes", "1", *SHAPES[shape], cwd=ROOT / "tests")


@pytest.mark.parametrize("shape", SHAPES)
def test_a_factory_that_returns_no_module_is_refused(tmp_path, shape):
    res = _prepare(tmp_path, {"name": "api_models:not_a_module"}, shape)
    refused(res, "model.name: api_models:not_a_module returned dict, not an nn.Module")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_keyword_the_factory_does_not_take_is_refused(tmp_path, shape):
    res = _prepare(tmp_path, {"name": "api_models:sized", "kwargs": {"widht": 4}}, shape)
    line = refused(res, "model.kwargs: api_models:sized(n_features: int, n_outputs: int, "
                         "width: int = 8)")
    assert "'widht'" in line, line
    assert not (tmp_path / "runs").exists()
    res = _prepare(tmp_path, {"name": "api_models:sized", "kwargs": {"width": 4}}, shape)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_factory_that_cannot_build_on_meta_prepares_trains_and_is_not_planned(tmp_path):
    res = _prepare(tmp_path / "gpu", {"name": "api_models:meta_refusing"}, "gpu")
    assert res.returncode == 0, res.stderr[-3000:]
    res = _prepare(tmp_path / "cpu", {"name": "api_models:meta_refusing"}, "cpu", "train")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "cpu" / "runs" / "fac" / "checkpoints" / "step-1" / "commit.json").exists()
    res = _prepare(tmp_path / "plan", {"name": "api_models:meta_refusing"}, "gpu", "plan")
    refused(res, "cannot be built on the meta device, so its memory plan is not known")
