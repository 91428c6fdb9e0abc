"""The Python API: `train()` and `predict()` drive the same runtime as `enn-submit`.

A call does not loop over `model.forward()` in the caller's process. It stages the data
into memmaps, writes the model's current weights as the run's step-0 checkpoint and its
structure without them (storage/model_structure.py), freezes the config, launches workers (local elastic workers, or Slurm tasks through submitit) and
reads back their artifacts.

    >>> import numpy as np, torch, enn_cluster
    >>> x = np.random.randn(512, 8).astype("float32"); y = x[:, :1] ** 2
    >>> run = enn_cluster.train(torch.nn.Sequential(torch.nn.Linear(8, 1)), x, y,
    ...                         training={"epochs": 2}, parallel={"nodes": 1, "procs_per_node": 2})
    >>> preds = enn_cluster.predict(run, x)          # numpy array, rows in input order
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from enn_cluster.client.launch_plan import LaunchPlan, Machine, plan_launch
from enn_cluster.client.launching import create_train_run, resolved_config, start
from enn_cluster.client.api_words import speaks_api
from enn_cluster.client.run_handle import Run
from enn_cluster.cluster.submit_slurm import SlurmRequest, check_slurm_here
from enn_cluster.config.launch_options import API_KEYS, asked
from enn_cluster.config.launch_shape import ShapeRequest
from enn_cluster.config.loading import config_to_dict
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.yaml_file import read_yaml
from enn_cluster.errors import UserError, did_you_mean
from enn_cluster.storage.rundir import RunDir

from enn_cluster.storage.model_structure import (
    FACTORY,
    from_structure,
    structure_bytes,
    write_structure,
)

MODEL_PICKLE = "model.pkl"
unpickled_model = from_structure  # the factory that runs made before FACTORY still name


def check_shippable(model: Any) -> Optional[bytes]:
    """What ships to workers must import there: refuse early, before anything is written.
    Returns a module's structure to ship (None for 'module:factory')."""
    if isinstance(model, str):
        module, sep, attr = model.partition(":")
        if not sep or not module or not attr:
            raise UserError(f"model: {model!r} is not 'package.module:factory'")
        return None
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model: expected an nn.Module or 'module:factory', got {type(model).__name__}")
    for sub in model.modules():
        cls = type(sub)
        where = f"{cls.__module__}.{cls.__qualname__}"
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            raise UserError(f"model: class {where} is defined in __main__, a notebook or a "
                            "function; workers cannot import it. Move it to a module on "
                            "PYTHONPATH (or pass 'module:factory')")
        try:
            found = importlib.import_module(cls.__module__)
            for part in cls.__qualname__.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is not cls:
            raise UserError(f"model: class {where} is not importable by that path; "
                            "define it at the top level of an importable module")
    try:
        return structure_bytes(model)
    except Exception as exc:  # pickle raises many types; all mean the same to the user
        raise UserError(f"model: cannot be pickled for the workers ({exc}); remove lambdas "
                        "and open handles from it or pass 'module:factory'")


def _config(config: Union[None, str, dict, RunConfig], overrides: dict, read_site) -> RunConfig:
    """The CLI's config step (launching.resolved_config) for the API's arguments: `config`
    as the file, keyword sections as --set, top-level keywords (run_dir's name and root)
    verbatim. A RunConfig names every key, runs_root included: the site's is not applied."""
    if isinstance(config, RunConfig):
        data = config_to_dict(config)
    elif isinstance(config, (str, Path)):
        data = read_yaml(str(config))
    else:
        data = dict(config or {})
    sets = [f"{section}.{k}={v!r}" if isinstance(v, str) else f"{section}.{k}={v}"
            for section, values in overrides.items() if isinstance(values, dict)
            for k, v in values.items()]
    verbatim = {k: v for k, v in overrides.items() if not isinstance(v, dict)}
    return resolved_config(data, sets, verbatim, read_site)


def _site_reader(cluster: Optional[dict]):
    """The site config as this call reads it, once: `cluster`'s `site`, else the lookup
    the CLI does ($ENN_SITE_CONFIG, ./enn-site.yaml, ...)."""
    from functools import cache

    from enn_cluster.cluster.site import load_site

    return cache(lambda: load_site((cluster or {}).get("site")))


def _arrays(X, y, eval_data) -> dict:
    arrays = {"x": X}
    if y is not None:
        arrays["y"] = y
    if eval_data is not None:
        arrays["eval_x"], arrays["eval_y"] = eval_data
    return arrays


def _write_step0(model, run: RunDir) -> None:
    """The module's current weights, as a committed DCP checkpoint at step 0."""
    import torch.distributed.checkpoint as dcp

    from enn_cluster.storage import commits as store

    path = store.step_dir(run.checkpoints, 0)
    path.mkdir(parents=True)
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    files = store.checksum_files(path, store.step_files(path))
    store.write_commit(path, 0, files, world_size=1, contents=["model"], source="api")


def _check_cluster(cluster) -> None:
    """`cluster=`: None (run here) or a dict of launch options by their API keys
    (config/launch_options.py); a key it does not know is refused, not ignored."""
    if cluster is None:
        return
    if not isinstance(cluster, Mapping):
        raise UserError(f"cluster: expected a dict such as {{'nodes': 2, 'partition': 'gpu'}} "
                        f"or None (run here), got {type(cluster).__name__}")
    for key in cluster:
        if key not in API_KEYS:
            raise UserError(f'cluster["{key}"]: unknown key{did_you_mean(key, API_KEYS)}; '
                            f"known keys: {', '.join(API_KEYS)}")


def _slurm_request(cluster: Optional[dict], read_site=None) -> Optional[SlurmRequest]:
    """The API's `cluster=` dict as the CLI's Slurm flags would give it, with the site config
    read once; None: run locally."""
    if cluster is None:
        return None
    return SlurmRequest(asked(cluster.get),
                        site_config=(read_site or _site_reader(cluster))())


def _plan(cfg: RunConfig, cluster: Optional[dict], task: str,
          slurm: Optional[SlurmRequest]) -> LaunchPlan:
    """The CLI's launch plan for the API's `cluster=` dict (a dict: Slurm; None: here); its
    warnings as Python's."""
    import warnings

    if slurm is not None:
        check_slurm_here()  # before the image and the rest of the job are looked for
    plan = plan_launch(cfg, ShapeRequest.from_cluster(cluster), task, slurm=slurm,
                       machine=Machine.here() if slurm is None else None)
    for line in plan.warnings:
        warnings.warn(line, RuntimeWarning, stacklevel=3)
    return plan


@speaks_api(run_dir="run_dir")
def train(model, X, y=None, *, config=None, eval_data=None, cluster: Optional[dict] = None,
          run_dir: Optional[str] = None, wait: bool = True, **overrides) -> Run:
    """Train `model` (an nn.Module or 'module:factory') on X/y; returns a `Run` handle.

    `config` is a RunConfig, a dict or a YAML path; keyword sections override it
    (`training={"epochs": 3}`). `cluster=None` runs locally; a dict such as
    `{"nodes": 2, "gpus_per_node": 8, "partition": "gpu", "container": "/img.sqsh"}` submits
    to Slurm. `wait=False` returns at once; `Run.open(path)` re-attaches later. The run
    lands at `run_dir`, else under the config's runs_root, else the site config's (as with
    `enn-submit train`).
    """
    _check_cluster(cluster)
    structure = check_shippable(model)
    if run_dir is not None:
        overrides = {**overrides, "run_name": Path(run_dir).name,
                     "runs_root": str(Path(run_dir).resolve().parent)}
    read_site = _site_reader(cluster)
    cfg = _config(config, overrides, read_site)
    if isinstance(model, str):
        cfg.model.name = model
    slurm = _slurm_request(cluster, read_site)

    def populate(run: RunDir) -> None:
        if structure is not None:
            write_structure(run.path / MODEL_PICKLE, structure)
            _write_step0(model, run)

    if structure is not None:
        final = Path(cfg.runs_root).expanduser().resolve() / cfg.run_name
        cfg.model.name = FACTORY
        cfg.model.kwargs = {"path": str(final / MODEL_PICKLE)}
    run, plan = create_train_run(_plan(cfg, cluster, "train", slurm),
                                 arrays=_arrays(X, y, eval_data), populate_extra=populate)
    return _start(run, plan, wait, fresh=True)


def _start(run: RunDir, plan: LaunchPlan, wait: bool, name: Optional[str] = None,
           step: Optional[int] = None, *, fresh: bool = False) -> Run:
    """The API's launch: the CLI's `start`, with its own returns (a Run, an exception).
    `fresh`: a run `train` just made (refused by sbatch: the run is removed, as the CLI's is)."""
    started = start(run, plan, name, step, wait=wait, fresh=fresh)
    if started.code:
        what = f"Slurm job {started.job_id}" if started.job_id is not None else "workers"
        raise RuntimeError(f"{what} for {run.path} " + (
            "did not complete" if started.job_id is not None
            else f"exited with code {started.code}") + f"; see 'enn-submit logs {run.path}'")
    return Run.open(run.path)


IN_MEMORY_LIMIT = 1 << 30  # larger outputs come back as a read-only memmap


@speaks_api()
def predict(run_or_dir, X, *, step: Optional[int] = None, cluster: Optional[dict] = None,
            name: Optional[str] = None, raw: bool = False, out: Optional[str] = None,
            chunk_rows: Optional[int] = None, batch_size: Optional[int] = None):
    """Predict X with a complete checkpoint of a run (default: the newest); rows in order.

    Same path as `enn-submit predict` + `collect`: X is staged, workers (local, or Slurm
    with `cluster=`) write verified chunks, and they are assembled into
    `predictions/<name>/assembled.npy` (or `out`). Outputs over 1 GiB come back as a
    read-only memmap. `raw=True` skips target de-normalisation.

        >>> preds = enn_cluster.predict(run, x_test)             # doctest: +SKIP
    """
    import numpy as np

    from enn_cluster.client.collect import ASSEMBLED, collect
    from enn_cluster.client.prediction_request import (
        DEFAULT_BATCH_SIZE,
        DEFAULT_CHUNK_ROWS,
        check_prediction_inputs,
        prepare_prediction,
    )

    _check_cluster(cluster)
    run = RunDir.existing(getattr(run_or_dir, "path", run_or_dir))
    cfg = run.load_config()
    plan = _plan(cfg, cluster, "predict", _slurm_request(cluster))
    check_prediction_inputs(run, cfg, X)
    request = prepare_prediction(run, X, name=name, step=step,
                                 chunk_rows=chunk_rows or DEFAULT_CHUNK_ROWS,
                                 batch_size=batch_size or DEFAULT_BATCH_SIZE, cfg=cfg)
    if not request.complete:
        _start(run, plan, True, name=request.name, step=request.step)
    target = out or str(request.path / ASSEMBLED[1 if raw else 0])
    result = collect(run, request.name, target, raw=raw, overwrite=out is None)
    import warnings

    for line in result.warnings + ([request.fallback] if request.fallback else []):
        warnings.warn(f"prediction {request.name}: {line}", RuntimeWarning, stacklevel=2)
    if out is not None and "://" in out:
        return out
    array = np.load(target, mmap_mode="r")
    return np.array(array) if array.nbytes <= IN_MEMORY_LIMIT else array


@speaks_api()
def export(run_or_dir, out, *, step: Optional[int] = None, format: str = "torch",
           dtype: Optional[str] = None, max_shard_mb: Optional[float] = None) -> Path:
    """`enn-submit export`: the checkpoint as `model.pt` (full state dict), with
    `format="export"` also a torch.export program `model.pt2`; a causal LM's `format="hf"`
    is streamed in `dtype` (the base's by default); returns the directory.

        >>> enn_cluster.export(run, "artifact", format="export")  # doctest: +SKIP
    """
    from enn_cluster.client.artifact_export import export_run

    return export_run(getattr(run_or_dir, "path", run_or_dir), out, step=step, fmt=format,
                      dtype=dtype, max_shard_mb=max_shard_mb)
