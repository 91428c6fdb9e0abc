"""Why a prediction came out near-constant: the candidates compared, and the verdict.

Each output the summary statistics call near-constant is traced back through the forms a
prediction passes through, and the first one that still varies names the culprit:

- per-sample input: the rows fed in (identical rows make identical predictions);
- fp32 re-run: the first batch again in float32, when prediction ran in bf16 (bf16 keeps
  8 significant bits: a small variation on a large value rounds away);
- raw: the model's output in normalised target units, when targets were normalised;
- denormalised: the raw output times the targets' std plus their mean (what is collected);
- calibrated: enn_cluster applies no calibration, so this candidate is never available.

Every value comes from the chunk records the workers wrote: pure, no torch, no file.
"""
from __future__ import annotations

from typing import Optional

COLLAPSE_REL_STD = 1e-3  # std below this fraction of the output's scale counts as constant


def near_constant(std: float, mean: float, scale: float = 0.0) -> bool:
    """std tiny against the output's scale (its magnitude, or a known spread); 0 always is."""
    return std <= COLLAPSE_REL_STD * max(abs(mean), scale, 1e-12)


def collapsed_outputs(stats: Optional[dict], scale: Optional[list[float]] = None) -> list[int]:
    """The outputs whose values barely vary across the samples."""
    if not stats or stats["count"] < 2:
        return []
    return [j for j, std in enumerate(stats["std"])
            if near_constant(std, stats["mean"][j], scale[j] if scale else 0.0)]


def _fp32_rerun(checks: list[dict], j: int, scale: float) -> Optional[dict]:
    """The first-batch fp32 re-run against the reduced-precision pass, for output j."""
    runs = [c for c in checks if c.get("reduced_precision") and "fp32_std" in c]
    if not runs:
        return None
    best = max(runs, key=lambda c: c["fp32_std"][j])
    return {"std": best["fp32_std"][j], "reduced_std": best["reduced_std"][j],
            "varies": not near_constant(best["fp32_std"][j], best["fp32_mean"][j], scale)
            and near_constant(best["reduced_std"][j], best["fp32_mean"][j], scale)}


def verdict(manifest: dict) -> Optional[dict]:
    """{"outputs", "verdict", "message", "candidates"} when some output is near-constant,
    else None. Verdicts: input, denormalization, precision, model."""
    scaler = manifest.get("scaler")
    scale = scaler["std"] if scaler else None
    outputs = collapsed_outputs(manifest.get("stats"), scale)
    if not outputs:
        return None
    j, stats = outputs[0], manifest["stats"]
    raw = manifest.get("raw_stats")
    checks = [c.get("precision_check") for c in manifest.get("chunks", ())]
    candidates = {
        "input": {"spread": manifest.get("input_spread"),
                  "varies": manifest.get("input_spread") != 0.0},
        "fp32_rerun": _fp32_rerun([c for c in checks if c], j, 1.0 if scaler else 0.0),
        "raw": None if not (scaler and raw) else {
            "std": raw["std"][j], "varies": not near_constant(raw["std"][j], raw["mean"][j], 1.0)},
        "denormalized": {"std": stats["std"][j], "mean": stats["mean"][j], "varies": False},
        "calibrated": None,  # no calibration stage in enn_cluster
    }
    where = f"output {j}"
    if candidates["input"]["spread"] == 0.0:
        kind, message = "input", (
            f"{where}: every input row is the same, so every prediction is: check the "
            "--input array (a broadcast, a fill value, a wrong column)")
    elif candidates["raw"] and candidates["raw"]["varies"]:
        kind, message = "denormalization", (
            f"{where}: the raw outputs vary (std {candidates['raw']['std']:.3g} in normalised "
            f"units); denormalised (times the targets' std {scale[j]:.3g}, plus their mean "
            f"{scaler['mean'][j]:.6g}) they vary by {stats['std'][j]:.3g}: the training "
            "targets themselves barely vary around their mean; compare with `collect --raw`")
    elif candidates["fp32_rerun"] and candidates["fp32_rerun"]["varies"]:
        kind, message = "precision", (
            f"{where}: an fp32 re-run of the first batch varies (std "
            f"{candidates['fp32_rerun']['std']:.3g}) where bf16 gives std "
            f"{candidates['fp32_rerun']['reduced_std']:.3g}: bf16 rounds the variation away "
            f"at magnitude {stats['mean'][j]:.6g}; predict again with "
            "--set training.bf16=false")
    else:
        kind, message = "model", (
            f"{where}: the inputs vary but every candidate (raw, fp32) is near-constant: the "
            "model itself outputs a constant; check the loss history (`enn-submit status`) "
            "or predict an earlier checkpoint with --step")
    return {"outputs": outputs, "verdict": kind, "message": message,
            "candidates": candidates}


def recorded_verdict(record) -> Optional[dict]:
    """A manifest's `collapse` value when it has the shape the workers write (a
    hand-edited manifest's odd value is left out, not printed)."""
    ok = isinstance(record, dict) and all(isinstance(record.get(k), str)
                                          for k in ("verdict", "message"))
    return record if ok else None
