"""`Run`: a handle on a run directory, for the Python API. Everything is read back from
the directory (and Slurm), so a handle re-attached later sees what the first one saw."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from enn_cluster.client.api_words import speaks_api
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.storage import commits as store
from enn_cluster.storage.metrics import read_metrics
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import read_lock


class Run:
    def __init__(self, path: Path) -> None:
        self.dir = RunDir(Path(path).resolve())

    @classmethod
    @speaks_api(run_dir="Run.open(path)")
    def open(cls, path) -> "Run":
        run = cls(RunDir.existing(path).path)
        run.dir.load_config()  # a damaged config.yaml: one line now
        return run

    @property
    def path(self) -> Path:
        return self.dir.path

    @property
    def config(self):
        return self.dir.load_config()

    def metrics(self, kind: Optional[str] = None) -> list[dict]:
        """Rank-0 metrics records (kind: train, eval, checkpoint, resume)."""
        return list(read_metrics(self.dir.metrics, kind))

    @property
    def latest_checkpoint(self) -> Optional[int]:
        return store.latest_committed(self.dir.checkpoints)

    def status(self) -> dict:
        from enn_cluster.client.status import run_status

        return run_status(self.path)

    def running(self) -> bool:
        return self.status()["lock"] is not None

    def wait(self, timeout: Optional[float] = None, poll_s: float = 1.0) -> "Run":
        """Block until no job holds the run (local launcher or Slurm job ended)."""
        deadline = None if timeout is None else time.time() + timeout
        time.sleep(min(poll_s, 0.5))
        while self.running() or (read_lock(self.dir) is None and not self.dir.jobs()):
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"{self.path} still running after {timeout} s")
            time.sleep(poll_s)
        return self

    def cancel(self) -> None:
        from enn_cluster.client.launching import cancel_run

        cancel_run(self.dir)

    @speaks_api()
    def load_model(self, step: Optional[int] = None, raw: bool = False):
        """The model with the full weights of a complete checkpoint, in this process. A
        causal LM comes with LoRA merged: `forward(input_ids)` gives its logits. With
        `data.normalize_targets` its outputs are in the targets' units, as `predict`'s are
        (a forward hook scales them back); `raw=True`: the normalised outputs it trained on."""
        from torch.distributed.checkpoint.api import CheckpointException

        from enn_cluster.models import build_run_model, output_size
        from enn_cluster.storage.dcp_io import safe_load
        from enn_cluster.storage.staging import read_manifest

        step = self.latest_checkpoint if step is None else step
        if step is None:
            raise UserError(f"step: {self.path} has no complete checkpoint yet; train or "
                            "resume it until one commits (enn-submit status shows them)")
        committed = store.committed_steps(self.dir.checkpoints)
        if step not in committed:
            raise UserError("step-{value} is not a complete checkpoint of {run}",
                            field=INPUTS["step"], value=step, run=self.path,
                            fix="complete ones: {steps}",
                            steps=", ".join(map(str, committed)) or "none")
        cfg, manifest = self.config, read_manifest(self.dir.data_dir)
        from enn_cluster.models import kind_of

        if kind_of(cfg).weights_dir(cfg) is not None:  # base weights of its own: an LM's
            from enn_cluster.client.lm_artifacts import load_lm

            return load_lm(cfg, store.step_dir(self.dir.checkpoints, step))
        model = build_run_model(cfg, tuple(manifest["entries"]["train_x"]["shape"][1:]),
                                output_size(cfg, manifest))
        state = {"model": model.state_dict()}
        path = store.step_dir(self.dir.checkpoints, step)
        try:
            safe_load(state, path)
            model.load_state_dict(state["model"])
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - metadata is untrusted
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
            raise UserError("step-{step}: {path} does not load into this run's model ({why})",
                            step=step, path=path, why=why, step_input=INPUTS["step"],
                            fix="restore the checkpoint or pick another {step_input}") from None
        scaler = manifest.get("target_scaler")
        if scaler and not raw:
            model.register_forward_hook(TargetUnits(scaler["mean"], scaler["std"]))
        return model.eval()

    def plot(self, out=None) -> Path:
        """PNG of loss, validation loss, lr and throughput (needs matplotlib)."""
        from enn_cluster.client.plot import plot_series, write_plot

        target = Path(out) if out is not None else self.path / "metrics.png"
        return write_plot(plot_series(read_metrics(self.dir.metrics)), target, self.path.name)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, latest_checkpoint={self.latest_checkpoint})"


class TargetUnits:
    """A forward hook: the model's normalised outputs back in the targets' units (what
    `predict` and `collect` do to the chunks), per flattened output column. A class, not a
    closure, so that a model carrying it still pickles."""

    def __init__(self, mean: list, std: list) -> None:
        self.mean, self.std = list(mean), list(std)

    def __call__(self, module, inputs, output):
        import torch

        flat = output.reshape(len(output), -1)
        std = torch.as_tensor(self.std, dtype=flat.dtype, device=flat.device)
        mean = torch.as_tensor(self.mean, dtype=flat.dtype, device=flat.device)
        return (flat * std + mean).reshape(output.shape)
