"""`enn-submit plot RUN`: loss, validation loss, lr and throughput over steps, one PNG.

Series come from the rank-0 metrics JSONL (`plot_series`, pure); restarts (every
`resume` record) are drawn as vertical lines, so a reader sees where a run was stopped,
crashed or moved to another world size. matplotlib is an optional extra.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from enn_cluster.errors import UserError


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # "nan"/"inf" strings: non-finite losses stay visible as gaps


def plot_series(records: Iterable[dict]) -> dict:
    """Steps and values per panel from metrics records; the last record of a step wins
    (a step redone after a restart replaces the lost attempt's value)."""
    train: dict = {}
    evals: dict = {}
    restarts: list = []
    for rec in records:
        kind = rec.get("kind")
        if kind == "train":
            train[rec["step"]] = rec
        elif kind == "eval":
            evals[rec["step"]] = _number(rec.get("eval_loss"))
        elif kind == "resume" and not rec.get("initial_weights"):  # an API run's start
            restarts.append({"step": rec["step"], "world_size": rec.get("world_size"),
                             "from_world": rec.get("from_world")})
    steps = sorted(train)
    return {
        "loss": (steps, [_number(train[s].get("loss")) for s in steps]),
        "eval_loss": (sorted(evals), [evals[s] for s in sorted(evals)]),
        "lr": (steps, [_number(train[s].get("lr")) for s in steps]),
        "samples_per_s": (steps, [_number(train[s].get("samples_per_s")) for s in steps]),
        "restarts": restarts,
    }


def write_plot(series: dict, out: Path, title: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot: needs matplotlib; pip install 'enn_cluster[plot]'")
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_loss, ax_lr, ax_tp = axes
    ax_loss.plot(*series["loss"], label="train loss", lw=1)
    if series["eval_loss"][0]:
        ax_loss.plot(*series["eval_loss"], "o-", label="validation loss")
    ax_loss.set_ylabel("loss")
    ax_lr.plot(*series["lr"], color="tab:green", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_tp.plot(*series["samples_per_s"], color="tab:purple", lw=1)
    ax_tp.set_ylabel("samples/s")
    ax_tp.set_xlabel("step")
    for i, restart in enumerate(series["restarts"]):
        for ax in axes:
            ax.axvline(restart["step"], color="tab:red", ls="--", lw=1,
                       label="restart" if i == 0 and ax is ax_loss else None)
    ax_loss.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
