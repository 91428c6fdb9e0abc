"""Where a command may write a file the user named (`collect --out`, `plot --out`): checked
before anything is made, so that a bad target is one line, not a traceback after the work,
and nothing is left behind."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from enn_cluster.config.checks import check_home
from enn_cluster.errors import UserError

PSEUDO_FS = ("/proc", "/sys", "/dev")  # kernel views: never a place for results
MAX_NAME_BYTES = 200  # NAME_MAX is 255: room for the temporary name written beside it


RUN_CONTROL_NAMES = ("config.yaml", "run.lock", "jobs.jsonl", "metrics.jsonl", "manifest.json")


def expanded(flag: str, path: str) -> str:
    """`~/x` and `~user/x` as the home they name; a `~name` no user has is refused (it would
    become a folder named '~name' in the current directory)."""
    path = str(path)
    check_home(flag, path)  # the config's paths are judged by the same words
    return os.path.expanduser(path)


def check_local_target(flag: str, path: str, overwrite: bool, run_dir=None,
                       own: tuple = ()) -> None:
    """A local output path: not under /proc, /sys or /dev; an existing target is a regular
    file (and only with overwrite); the nearest existing parent is a writable directory.
    Never a file of the run `run_dir` (its config, lock, records, data, checkpoints,
    chunks), whatever --overwrite says; `own`: names in the run this command itself writes."""
    target = Path(os.path.abspath(os.path.expanduser(path)))
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in target.parts)
    if longest > MAX_NAME_BYTES or len(str(target).encode("utf-8", "surrogateescape")) > 4000:
        raise UserError.on(flag, f"{path[:80]}... is too long a path (a name of {longest} bytes; "
                                 f"keep each name under {MAX_NAME_BYTES} bytes)")
    real = Path(os.path.realpath(target))
    if run_dir is not None:
        _not_the_runs(flag, path, real, Path(os.path.realpath(run_dir)), own)
    if any(str(p) == root or str(p).startswith(root + "/") for p in (target, real)
           for root in PSEUDO_FS):
        raise UserError.on(flag, f"{path} is under {'/'.join(real.parts[:2]) or '/'} (a kernel "
                                 "file system); write to a directory of your own")
    if os.path.lexists(target):
        st = os.stat(target) if os.path.exists(target) else os.lstat(target)
        if stat.S_ISDIR(st.st_mode):
            raise UserError.on(flag, f"{path} is a directory; name a file in it")
        if not stat.S_ISREG(st.st_mode):
            raise UserError.on(flag, f"{path} is not a regular file (a device, pipe or dangling "
                                     "link); name a regular file")
        if not overwrite:
            raise UserError.on(flag, f"{path} exists", fix="choose another path or pass "
                               "--overwrite", api_fix="choose another path")
    parent = target.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError.on(flag, f"{parent} is not a directory, so {path} cannot be made; "
                                 "choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError.on(flag, f"{parent} is not writable; choose another path")


def _not_the_runs(flag: str, path: str, real: Path, run: Path, own: tuple) -> None:
    """Inside the run directory only a new file at its top level (or one of `own`)."""
    try:
        rel = real.relative_to(run)
    except ValueError:
        return
    if rel.parts and len(rel.parts) == 1 and (rel.name in own or (
            rel.name not in RUN_CONTROL_NAMES and not os.path.lexists(real))):
        return
    raise UserError.on(flag, f"{path} is a file of the run {run} (or inside one of its "
                             "folders); write the output outside the run directory")


def missing_parents(path: Path) -> list[Path]:
    """The parent folders of `path` that do not exist yet, innermost first."""
    missing = []
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_empty(folders: list) -> None:
    """Remove the folders `missing_parents` listed (innermost first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return
