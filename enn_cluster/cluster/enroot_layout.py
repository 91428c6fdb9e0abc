"""The files Enroot writes into an image it imports, as pure text from the image config.

`enroot import` turns a container's config (ENV, WORKDIR, ENTRYPOINT, CMD, VOLUMEs, labels)
into four files inside the rootfs; Enroot and Pyxis read those at container start instead of
the config. Building the squashfs ourselves (no Enroot on the build host) must produce the
same files, so a container started by Pyxis behaves as if Enroot had imported the image.
This mirrors `docker::configure` and `common::fixperms` in Enroot's sources. The text is
pure; `apply_layout` is the one function that touches a rootfs directory.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from enn_cluster.errors import UserError

RC_LOCAL = (
    "# This file is sourced by /etc/rc when the container starts.\n"
    "# It can be used to manipulate the entrypoint or the command of the container.\n"
)

# Paths (relative to the rootfs) Enroot leaves out of an imported image: device nodes make an
# unprivileged `enroot create` fail, and /.dockerenv would make tools think they run in Docker.
DROPPED_PATHS = ("dev/*", ".dockerenv")

_ANSI_C_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                   "\t": "\\t", "\v": "\\v", "\x1b": "\\E", "\\": "\\\\", "'": "\\'"}


def bash_quote(word: str) -> str:
    """`${word@Q}` as bash 5 writes it: Enroot quotes ENTRYPOINT/CMD words this way in /etc/rc."""
    if all(ch.isprintable() for ch in word):
        return "'" + word.replace("'", "'\\''") + "'"
    out = []
    for ch in word:
        if ch in _ANSI_C_ESCAPES:
            out.append(_ANSI_C_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\{byte:03o}" for byte in ch.encode())
    return "$'" + "".join(out) + "'"


def image_config(inspect: Mapping) -> dict:
    """The `config` section of one `podman/docker image inspect` entry (keys as in the OCI spec).

    Enroot lower-cases the top-level keys, so both `Config` (podman/docker) and `config` (OCI
    image config) are accepted.
    """
    lowered = {str(key).lower(): value for key, value in inspect.items()}
    return dict(lowered.get("config") or {})


def rc_text(config: Mapping, provenance: str = "") -> str:
    """/etc/rc: provenance and labels as comments, cd to WORKDIR, source rc.local, exec."""
    head = [f"# enroot-provenance: {provenance}"] if provenance else []
    head += [f"# {key} {value}" for key, value in (config.get("Labels") or {}).items()]
    cwd = workdir(config)
    entrypoint = list(config.get("Entrypoint") or [])
    cmd = list(config.get("Cmd") or [])
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    ep = " ".join(bash_quote(word) for word in entrypoint)
    args = " ".join(bash_quote(word) for word in cmd)
    body = (
        f'mkdir -p "{cwd}" 2> /dev/null\n'
        f'cd "{cwd}" && unset OLDPWD || exit 1\n'
        "\n"
        "if [ -s /etc/rc.local ]; then\n"
        "    . /etc/rc.local\n"
        "fi\n"
        "\n"
        "if [ $# -gt 0 ]; then\n"
        f'    exec {ep} "$@"\n'
        "else\n"
        f"    exec {ep} {args}\n"
        "fi\n"
    )
    return "".join(line + "\n" for line in head) + ("\n" if head else "") + body


def environment_text(config: Mapping) -> str:
    """/etc/environment: the image's ENV lines (`NAME=value`), one per line, unquoted."""
    return "".join(f"{line}\n" for line in config.get("Env") or [])


def fstab_text(config: Mapping) -> str:
    """/etc/fstab: each VOLUME becomes a bind mount of a directory inside the rootfs."""
    return "".join(f"${{ENROOT_ROOTFS}}{vol} {vol} none x-create=dir,bind,rw,nosuid,nodev\n"
                   for vol in (config.get("Volumes") or {}))


def enroot_files(config: Mapping, provenance: str = "") -> dict[str, str]:
    """Rootfs-relative path -> text of every file Enroot writes from the image config."""
    return {
        "etc/rc": rc_text(config, provenance),
        "etc/rc.local": RC_LOCAL,
        "etc/environment": environment_text(config),
        "etc/fstab": fstab_text(config),
    }


def workdir(config: Mapping) -> str:
    """The directory /etc/rc changes to; Enroot creates it in the rootfs at import."""
    return config.get("WorkingDir") or "/"


def tar_excludes(paths: Sequence[str] = DROPPED_PATHS) -> list[str]:
    """GNU tar arguments that drop `paths` whether the archive names start with `./` or not."""
    return ["--anchored", *(f"--exclude={prefix}{path}" for path in paths for prefix in ("", "./"))]


# ------------------------------------------------------------ acting: apply to a rootfs dir

def _make_dirs_inside(rootfs: Path, relpath: str) -> None:
    """mkdir -p below rootfs that stops at symlinks, so it never writes outside the rootfs."""
    current = rootfs
    for part in Path(relpath.strip("/")).parts:
        current = current / part
        if current.is_symlink():
            return
        if not current.exists():
            current.mkdir(mode=0o755)


def apply_layout(rootfs: Path, config: Mapping, provenance: str = "") -> None:
    """Make an exported rootfs look as `enroot import` leaves it (before mksquashfs -all-root).

    Files become owner-readable and top directories owner-writable (Enroot's fixperms: in the
    container every file belongs to the job user), then the four files and WORKDIR are added.
    """
    subprocess.run(["chmod", "-f", "-R", "u+rX", str(rootfs)], check=False)
    subprocess.run(["find", str(rootfs), "-maxdepth", "5", "-type", "d", "!", "-perm", "-u=w",
                    "-exec", "chmod", "-f", "u+w", "{}", "+"], check=False)
    if (rootfs / "etc").is_symlink():
        raise UserError("the image's /etc is a symlink: cannot write Enroot's files into it")
    _make_dirs_inside(rootfs, "etc")
    for rel, text in enroot_files(config, provenance).items():
        path = rootfs / rel
        if path.is_symlink() or path.exists():
            path.unlink()  # never write through an image symlink onto the host
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    _make_dirs_inside(rootfs, workdir(config))
