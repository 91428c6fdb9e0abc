"""What a `model.name: hf:...` names: a local weights directory, never the network."""
from __future__ import annotations

import json
import math
import os
import stat
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
    path = check_model_files(path, "model.name")
    check_no_custom_code(path, "model.name")
    return path


CONFIG_LIMIT = 16 << 20  # config.json, tokenizer.json and the like: far more than any real one
_SMALL = (".json", ".txt", ".model", ".jinja")


def check_no_custom_code(folder: Path, field: str) -> None:
    """transformers runs Python files of a weights folder whose config.json (or
    tokenizer_config.json) has an `auto_map`, once someone answers its prompt; we never
    do: every load passes trust_remote_code=False, and such a folder is refused here in one
    line that names the file and the model type, before any library reads it."""
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError, RecursionError):
            continue  # the library's own load says what is wrong with it
        if isinstance(data, dict) and data.get("auto_map"):
            kind = data.get("model_type") or data.get("tokenizer_class") or "unnamed"
            raise UserError(f"{field}: {path} asks for custom code (auto_map; model_type "
                            f"{str(kind)[:80]!r}), and enn_cluster never runs code that comes "
                            "with weights; use a model whose type transformers has, or convert "
                            "it to one")


def check_model_files(folder: Path, field: str) -> Path:
    """`folder` resolved, once each file in it is a regular file where its symlinks lead (an
    HF cache snapshot is symlinks into blobs/, so symlinks are followed; a FIFO or a device
    would hang transformers' reads, a symlink loop or dangling link would be a traceback),
    and its small text files (config.json, tokenizer files) are of a sane size."""
    for entry in sorted(Path(folder).iterdir()):
        try:
            st = os.stat(entry)  # follows symlinks: the file the libraries will open
        except OSError as exc:  # ELOOP, a dangling link
            raise UserError(f"{field}: {entry} cannot be read ({exc.strerror or exc}); "
                            "restore the file save_pretrained wrote") from None
        if stat.S_ISDIR(st.st_mode) and not entry.name.endswith(_SMALL):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{field}: {entry} is not a regular file (a FIFO, a device or a "
                            "directory); restore the file save_pretrained wrote")
        if entry.name.endswith(_SMALL) and st.st_size > CONFIG_LIMIT:
            raise UserError(f"{field}: {entry} is {st.st_size} bytes, more than such a file "
                            "can hold; restore the file save_pretrained wrote")
    return Path(folder).resolve()


def end_token_ids(folder: Path) -> list[int]:
    """The tokens at which the model's own `generate` stops: generation_config.json's
    `eos_token_id` (one id or a list), else config.json's, as transformers' from_pretrained
    reads them. They differ in real folders: Llama-3-Instruct's config.json names
    <|end_of_text|> and its generation_config.json <|eot_id|> too (where a chat turn ends),
    Phi-3's adds <|end|>. One line when the value is not token ids."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise UserError(f"model.name: {path} is not readable JSON "
                            f"({str(exc).splitlines()[0][:120]}); restore the file "
                            "save_pretrained wrote") from None
        ids = data.get("eos_token_id") if isinstance(data, dict) else None
        ids = [ids] if type(ids) is int else ids
        if ids is None:
            continue
        if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
            raise UserError(f"model.name: {path}: eos_token_id {str(ids)[:80]} is not a token "
                            "id or a list of them; restore the file save_pretrained wrote")
        return ids
    return []


# generation_config.json's sampling settings that `--seed` draws with, and what each must be
# (transformers loads any value and fails on it inside `generate`, on every rank)
SAMPLING = {"temperature": ("a number above 0", lambda v: v > 0),
            "top_p": ("a number above 0, at most 1", lambda v: 0 < v <= 1),
            "top_k": ("a whole number, 0 or more", lambda v: v >= 0 and v == int(v))}


def check_sampling(folder: Path) -> None:
    """The sampling settings of the folder's generation_config.json are usable; one line
    naming the first that is not."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return  # end_token_ids, read first, names what is wrong with it
    for key, (what, ok) in SAMPLING.items():
        value = data.get(key) if isinstance(data, dict) else None
        if value is not None and not (type(value) in (int, float) and math.isfinite(value)
                                      and ok(value)):
            raise UserError(f"model.name: {path}: {key} {repr(value)[:40]} is not {what}; "
                            "fix it, or predict greedily (without --seed)")
