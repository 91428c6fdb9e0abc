"""Pyxis srun flags: validated here, before a job waits in the queue for hours.

Why strict: Pyxis splits `--container-mounts` on ',' and ':', writes mount entries into
an fstab-like table (spaces split fields) and variable names into a shell snippet, and
prepends `docker://` to any image that does not start with '/' or './'. A bad value
fails only when the job starts, on every node. Everything here is pure.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError, looks_secret

# Mount flags Pyxis passes to enroot (joined with '+', e.g. "ro+rprivate").
MOUNT_FLAGS = frozenset({
    "ro", "rw", "nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime",
    "bind", "rbind", "private", "rprivate", "slave", "rslave", "shared", "rshared",
})
SQUASHFS_SUFFIXES = (".sqsh", ".squashfs", ".sqfs")
BARE_METAL = (None, "", "none")

_PATH_CHARS = re.compile(r"^[\w./+@=~%-]+\Z")  # \w includes unicode letters and digits
_REF = re.compile(r"^(?:[\w.-]+@)?(?:[\w.:-]+#)?[\w./-]+(?::[\w.-]+)?(?:@sha256:[0-9a-f]{64})?\Z",
                  re.ASCII)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        tail = ":" + "+".join(self.flags) if self.flags else ""
        return f"{self.src}:{self.dst}{tail}"


def _bad_char(value: str) -> Optional[str]:
    for ch in value:
        if not _PATH_CHARS.match(ch):
            return repr(ch)
    return None


def check_path(path: str, field: str, what: str = "path") -> str:
    """An absolute path Pyxis and #SBATCH lines can carry unquoted."""
    if not isinstance(path, str) or not path:
        raise UserError.on(field, f"{what} is empty; give an absolute path")
    if not path.startswith("/"):
        raise UserError.on(field, f"{what} {path!r} must be absolute (start with /)")
    bad = _bad_char(path)
    if bad:
        raise UserError.on(field, f"{what} {path!r} contains {bad}, which Pyxis cannot carry "
                                  "(',' and ':' separate mounts, spaces split its mount table, quotes "
                                  "and '$' reach a shell); use letters, digits and . _ - + / @ = ~ %")
    return path


def parse_mount(text: str, field="--container-mounts") -> Mount:
    """'SRC:DST[:FLAGS]' with absolute paths and flags from MOUNT_FLAGS ('+'-joined)."""
    if not isinstance(text, str) or not text:
        raise UserError.on(field, "empty mount; write SRC:DST[:FLAGS], e.g. /data:/data:ro")
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise UserError.on(field, f"{text!r} is not SRC:DST[:FLAGS] (paths cannot contain ':' "
                                  "or ','); e.g. /shared/data:/data:ro")
    src = check_path(parts[0], field, "mount source")
    dst = check_path(parts[1], field, "mount target")
    flags = tuple(f for f in parts[2].split("+") if f) if len(parts) == 3 else ()
    unknown = [f for f in flags if f not in MOUNT_FLAGS]
    if unknown or (len(parts) == 3 and not flags):
        raise UserError.on(field, f"mount {text!r} has unknown flags {unknown or [parts[2]]}; "
                                  f"use {'+'.join(('ro', 'rprivate'))}-style flags from "
                                  f"{', '.join(sorted(MOUNT_FLAGS))}")
    if "ro" in flags and "rw" in flags:
        raise UserError.on(field, f"mount {text!r} is both ro and rw; keep one")
    return Mount(src, dst, flags)


def parse_mounts(items: Union[str, Iterable[str], None],
                 field="--container-mounts") -> tuple[Mount, ...]:
    """A comma-joined string or a list of entries (each may itself hold commas)."""
    if items is None:
        return ()
    labelled = [(field, items)] if isinstance(items, str) else [
        (field.item(i) if hasattr(field, "item") else f"{field}[{i}]", item)
        for i, item in enumerate(items)]
    return tuple(parse_mount(entry.strip(), label)
                 for label, item in labelled for entry in str(item).split(","))


def is_bare_metal(image: Optional[str]) -> bool:
    return image in BARE_METAL


def is_squashfs(image: str) -> bool:
    return image.startswith(("/", "./", "../", "~")) or image.endswith(SQUASHFS_SUFFIXES)


def check_image(image: str, field=INPUTS["container_image"]) -> str:
    """A squashfs path ('/'- or './'-prefixed) or a registry reference, unchanged."""
    if looks_secret(image):  # user:PASS@registry#img: it would be written into the script
        raise UserError.on(field, "holds a password or token (not shown); give registry "
                                  "credentials through Enroot's credentials file "
                                  "(ENROOT_CONFIG_PATH/.credentials), never in the image reference")
    if "://" in image:
        scheme = image.split("://", 1)[0]
        fix = ("build a squashfs (enroot import -o IMG.sqsh podman://TAG) and pass its path"
               if scheme != "docker" else "drop 'docker://': Pyxis adds it")
        raise UserError.on(field, f"{image!r}: Pyxis takes a squashfs path or a registry "
                                  f"reference without a scheme; {fix}")
    if is_squashfs(image):
        if image.startswith("~"):
            raise UserError.on(field, f"{image!r}: '~' is not expanded on the nodes; "
                                      "write the absolute path")
        if not image.startswith(("/", "./")):
            raise UserError.on(field, f"{image!r} is a relative path; Pyxis would read it "
                                      "as a registry image: make it absolute (or ./-prefixed)")
        body = "/" + image[2:] if image.startswith("./") else image
        check_path(body, field, "image path")
        return image
    if not _REF.match(image):
        raise UserError.on(field, f"{image!r} is neither a squashfs path nor a registry "
                                  "reference like nvcr.io#nvidia/pytorch:24.05-py3")
    return image


def image_arg(image: str, *, relative: bool = False, cwd: Optional[str] = None,
              field=INPUTS["container_image"]) -> str:
    """The `--container-image` value: a squashfs path made absolute against `cwd` (or
    './'-prefixed when `relative`, resolved by Pyxis in the job's directory); a registry
    reference unchanged."""
    if not is_squashfs(image) or image.startswith("~"):
        return check_image(image, field)
    if relative and not image.startswith("/"):
        norm = os.path.normpath(image)
        if norm.startswith(".."):
            raise UserError.on(field, f"{image!r} leaves the job directory; use an "
                                      "absolute path")
        return check_image("./" + norm, field)
    base = cwd if cwd is not None else os.getcwd()
    return check_image(os.path.normpath(os.path.join(base, image)), field)


def sbatch_escape_image(image: str) -> str:
    """For an `#SBATCH --container-image=` line, where an unescaped '#' starts a comment."""
    return image.replace("#", "\\#")


def check_env_names(names: Iterable[str], field: str = "--container-env") -> tuple[str, ...]:
    out = []
    for name in names:
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise UserError.on(field, f"{name!r} is not an environment variable name "
                                      "(letters, digits and _, not starting with a digit)")
        if name not in out:
            out.append(name)
    return tuple(out)


# The Pyxis flags of a job, in srun order: (flag, value key, the value in the admin
# templates' shell, given only when non-empty). srun_container_flags fills them from Python
# values (the submitit path); job_script.srun_shell_lines writes them as bash over the
# templates' ENN_* variables. One list, so the two ways a job reaches srun cannot drift.
CONTAINER_FLAGS = (
    ("--container-image", "image", "$ENN_IMAGE", False),
    ("--container-mounts", "mounts", "${ENN_MOUNTS:+$ENN_MOUNTS,}$ENN_RUN_DIR:$ENN_RUN_DIR", False),
    ("--container-workdir", "workdir", "$ENN_WORKDIR", True),
    ("--no-container-mount-home", "no_home", None, False),
    ("--container-env", "env", "$ENN_CONTAINER_ENV", True),
)


def srun_container_flags(image: Optional[str], mounts: Sequence[Union[Mount, str]] = (),
                         workdir: Optional[str] = None, env_names: Iterable[str] = (),
                         *, mount_home: bool = False) -> list[str]:
    """Pyxis flags for srun, in CONTAINER_FLAGS order; [] for bare metal (no container)."""
    if is_bare_metal(image):
        return []
    parsed = [m if isinstance(m, Mount) else parse_mount(m) for m in mounts]
    values = {"image": check_image(image), "mounts": ",".join(str(m) for m in parsed),
              "workdir": check_path(workdir, "--container-workdir") if workdir else "",
              "no_home": not mount_home, "env": ",".join(check_env_names(env_names))}
    flags = []
    for flag, key, _, _ in CONTAINER_FLAGS:
        value = values[key]
        if value is True:
            flags.append(flag)
        elif value:
            flags.append(f"{flag}={value}")
    return flags
