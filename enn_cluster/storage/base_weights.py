"""The identity of a LoRA run's frozen base weights: every file of the weights folder that
changes what the model computes (the safetensors, config.json, generation_config.json, the
safetensors index, the tokenizer files), each with its own checksum.

A LoRA checkpoint holds the adapters only, so the identity is recorded in every one of them
(the commit record and the trainer state): a resume, a prediction or an export over other
base weights would silently use another model, so each is refused, naming the file that
changed. `checksum` keeps its first meaning (the safetensors files alone): a record written
before `files` existed is compared on it, so such a run stays usable.
"""
from __future__ import annotations

from pathlib import Path

from enn_cluster.errors import UserError
from enn_cluster.storage import commits as store
from enn_cluster.storage.checksum import RunningChecksum, file_checksum
from enn_cluster.storage.text_sources import TOKENIZER_FILES

OUTPUT_FILES = ("config.json", "generation_config.json",
                "model.safetensors.index.json") + TOKENIZER_FILES


def identity(weights: Path, read_weights: bool = True) -> dict:
    """{"path", "checksum" (the safetensors files: names and bytes, sorted by name),
    "files" ({name: "size:checksum"} of every file that changes outputs)}. Without
    `read_weights` the safetensors are left unread (checksum None): the small files alone,
    what a login node checks before it starts workers that read the rest."""
    running, files = RunningChecksum(), {}
    for file in sorted(Path(weights).glob("*.safetensors")) if read_weights else ():
        # user input, not a run file: an HF cache snapshot's files are symlinks into blobs/,
        # so the checksum reads where they lead (still refused: a FIFO, a device, a loop)
        size, digest = file_checksum(_followed(file))
        running.update(f"{file.name}:{size}:{digest}\n".encode())
        files[file.name] = f"{size}:{digest}"
    for name in OUTPUT_FILES:
        if (Path(weights) / name).exists():
            size, digest = file_checksum(_followed(Path(weights) / name))
            files[name] = f"{size}:{digest}"
    return {"path": str(weights), "checksum": running.hexdigest() if read_weights else None,
            "files": files}


def changed_files(saved: dict, current: dict) -> list[str]:
    """The files whose checksum differs, or that came or went, since `saved` was recorded
    (a record from before `files`: "safetensors files" when their checksum differs); only
    the files `current` read. Pure."""
    then, read_weights = saved.get("files"), current["checksum"] is not None
    if not isinstance(then, dict):
        return ["safetensors files"] if read_weights and \
            saved.get("checksum") != current["checksum"] else []
    now = current["files"]
    return sorted(n for n in set(then) | set(now) if then.get(n) != now.get(n)
                  and (read_weights or not n.endswith(".safetensors")))


def check_step_base(step_dir: Path, weights: Path, read_weights: bool = True) -> None:
    """`check_same_base` for a checkpoint on disk (its commit record's identity)."""
    record = store.read_commit(step_dir) or {}
    check_same_base(record.get("base_weights"), identity(weights, read_weights),
                    int(record.get("step", -1)))


def check_same_base(saved: dict | None, current: dict, step: int) -> None:
    """A LoRA checkpoint's adapters belong to the base weights it was trained on."""
    changed = changed_files(saved, current) if isinstance(saved, dict) else []
    if changed:
        more = f" (and {', '.join(changed[1:4])})" if len(changed) > 1 else ""
        raise UserError(
            f"model.name: checkpoint step-{step} holds LoRA adapters trained on the base weights "
            f"in {saved.get('path')}, but {_what(changed[0], saved, current)} in "
            f"{current['path']} since{more}; restore that file as it was, or start a new run")


def _what(name: str, saved: dict, current: dict) -> str:
    then, now = saved.get("files") or {}, current["files"]
    if name in then and name not in now:
        return f"{name} was removed"
    if name in now and name not in then and then:
        return f"{name} was added"
    return f"{name} changed" if then else f"the {name} changed"


def _followed(file: Path) -> Path:
    try:
        return file.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UserError(f"model.name: {file} cannot be read ({why}); restore the weights "
                        "save_pretrained wrote") from None
