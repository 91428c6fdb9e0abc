"""The identity of a LoRA run's frozen base weights (a checksum of its safetensors files).

A LoRA checkpoint holds the adapters only, so it is recorded in every one of them (the
commit record and the trainer state): a resume, a prediction or an export over other base
weights would silently use another model, so each is refused.
"""
from __future__ import annotations

from pathlib import Path

from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import RunningChecksum, file_checksum


def identity(weights: Path) -> dict:
    """{"path", "checksum"} of the safetensors files (names and bytes, sorted by name)."""
    running = RunningChecksum()
    for file in sorted(Path(weights).glob("*.safetensors")):
        # user input, not a run file: an HF cache snapshot's files are symlinks into blobs/,
        # so the checksum reads where they lead (still refused: a FIFO, a device, a loop)
        size, digest = file_checksum(_followed(file))
        running.update(f"{file.name}:{size}:{digest}\n".encode())
    return {"path": str(weights), "checksum": running.hexdigest()}


def check_same_base(saved: dict | None, current: dict, step: int) -> None:
    """A LoRA checkpoint's adapters belong to the base weights it was trained on."""
    if saved and saved.get("checksum") != current["checksum"]:
        raise UserError(
            f"model.name: checkpoint step-{step} holds LoRA adapters trained on the base weights "
            f"in {saved.get('path')} (checksum {saved.get('checksum')}), but {current['path']} "
            f"now holds other weights (checksum {current['checksum']}); restore those weights "
            "or start a new run")


def _followed(file: Path) -> Path:
    try:
        return file.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UserError(f"model.name: {file} cannot be read ({why}); restore the weights "
                        "save_pretrained wrote") from None
