"""What a `model.name: hf:...` names: a local weights directory, never the network."""
from __future__ import annotations

from pathlib import Path

from enn_cluster.config.lm_config import HF_PREFIX
from enn_cluster.errors import UserError


def weights_dir(name: str) -> Path:
    """`hf:/dir` -> the directory; `hf:org/name` -> its snapshot in the local HF cache. One
    line naming the fix when neither holds a config.json."""
    ref = name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name
    path = Path(ref).expanduser()
    if not path.is_dir() and not ref.startswith(("/", ".", "~")):
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(ref, local_files_only=True))
        except Exception:  # not cached (or not a repo id): the message below says what to do
            pass
    if not (path / "config.json").is_file():
        raise UserError(f"model.name: {name!r} names no directory with a config.json (and no "
                        "model in the local Hugging Face cache); give hf:/path/to/weights, the "
                        "directory save_pretrained wrote (the network is never used)")
    return path.resolve()
