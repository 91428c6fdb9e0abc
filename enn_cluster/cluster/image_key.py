"""Which image a job runs: a content key of the build's inputs, and its squashfs in the cache.

The key hashes the Dockerfile, the build context the builder can see (after .dockerignore,
with Docker's rules) and the build args, so an unchanged tree is never rebuilt and a changed
one is never served a stale image. Submit needs only this lookup, never the build
(`cluster/image.py`); it reads files and runs nothing. Never imports torch.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from enn_cluster.errors import UserError

KEY_FORMAT = "enn-image/1"  # bump when the image layout we produce changes


# ---------------------------------------------------------------- pure: build context and key

@dataclass(frozen=True)
class IgnoreRule:
    """One .dockerignore line: `exclude` is False for `!` exceptions."""

    pattern: str
    exclude: bool
    regex: re.Pattern


def _glob_regex(pattern: str) -> re.Pattern:
    """Docker's pattern syntax: `*` and `?` stop at `/`, `**` spans directories."""
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            out += ".*" if i >= len(pattern) else "(.*/)?"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            out += pattern[i:end + 1]  # character classes pass through, as in Docker
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def parse_dockerignore(text: str) -> list[IgnoreRule]:
    """Rules in file order; like Docker, paths are cleaned and made relative to the context."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line if exclude else line[1:].strip()
        pattern = posixpath.normpath(pattern)
        if len(pattern) > 1 and pattern.startswith("/"):
            pattern = pattern.lstrip("/")
        rules.append(IgnoreRule(pattern, exclude, _glob_regex(pattern)))
    return rules


def is_ignored(relpath: str, rules: list[IgnoreRule]) -> bool:
    """Docker's rule: the last rule matching the path or one of its parents decides."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for rule in rules:
        if rule.exclude != ignored and any(rule.regex.match(c) for c in candidates):
            ignored = rule.exclude
    return ignored


def _may_reinclude(reldir: str, rules: list[IgnoreRule]) -> bool:
    """Whether some `!` rule could match a path below the ignored directory `reldir`."""
    depth = reldir.count("/") + 1
    for rule in rules:
        if rule.exclude:
            continue
        parts = rule.pattern.split("/")
        if "**" in rule.pattern:
            return True
        prefix = "/".join(parts[:depth])
        if len(parts) > depth and _glob_regex(prefix).match(reldir):
            return True
    return False


def image_path(cache_dir: str | os.PathLike, key: str) -> Path:
    """Where the squashfs for `key` lives in the cache."""
    return Path(cache_dir) / f"enn-{key[:16]}.sqsh"


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$ENN_IMAGE_CACHE, else the user cache dir; on a cluster point it at a shared filesystem."""
    if environ.get("ENN_IMAGE_CACHE"):
        return Path(environ["ENN_IMAGE_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "~"), ".cache")
    return Path(base).expanduser() / "enn_cluster" / "images"



# ------------------------------------------------------- reading the context (files, no writes)

def context_entries(context: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """(relative path, fingerprint) of every file, link and directory the build can see."""
    context = Path(context)
    ignore_file = context / ".dockerignore"
    rules = parse_dockerignore(ignore_file.read_text()) if ignore_file.is_file() else []
    for top, dirs, files in os.walk(context):
        reltop = Path(top).relative_to(context).as_posix()
        prefix = "" if reltop == "." else reltop + "/"
        kept_dirs = []
        for name in sorted(dirs):
            rel, full = prefix + name, os.path.join(top, name)
            if os.path.islink(full):
                files.append(name)
            elif not is_ignored(rel, rules):
                kept_dirs.append(name)
                yield rel, "d"
            elif _may_reinclude(rel, rules):
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(files):
            rel, full = prefix + name, os.path.join(top, name)
            if not is_ignored(rel, rules):
                yield rel, _fingerprint(full)


def _fingerprint(path: str) -> str:
    """Content hash plus the exec bit (COPY keeps modes; umask-only differences do not count)."""
    if os.path.islink(path):
        return "l:" + os.readlink(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    executable = os.stat(path).st_mode & 0o100
    return f"f:{'x' if executable else '-'}:{digest.hexdigest()}"


def image_key(dockerfile: str | os.PathLike, context: str | os.PathLike,
              build_args: Mapping[str, str] | None = None) -> str:
    """sha256 hex of the Dockerfile, the visible context and the build args."""
    digest = hashlib.sha256(f"{KEY_FORMAT}\n".encode())
    digest.update(hashlib.sha256(Path(dockerfile).read_bytes()).hexdigest().encode() + b"\n")
    for key, value in sorted((build_args or {}).items()):
        digest.update(f"arg\0{key}={value}\n".encode())
    for rel, fingerprint in context_entries(context):
        digest.update(f"{rel}\0{fingerprint}\n".encode())
    return digest.hexdigest()


def find_cached_image(dockerfile: str | os.PathLike, context: str | os.PathLike,
                      cache_dir: str | os.PathLike, *,
                      build_args: Mapping[str, str] | None = None) -> Path | None:
    """The cached squashfs for the current sources, or None when it was not built yet."""
    path = image_path(cache_dir, image_key(dockerfile, context, build_args))
    return path if path.is_file() else None


def image_for(dockerfile: str | os.PathLike, context: str | os.PathLike,
              cache_dir: str | os.PathLike, *,
              build_args: Mapping[str, str] | None = None) -> Path:
    """The squashfs train/predict jobs start from; UserError naming the fix when missing."""
    path = find_cached_image(dockerfile, context, cache_dir, build_args=build_args)
    if path is None:
        raise UserError(f"no container image built for the current sources in {cache_dir}: "
                        f"run `enn-submit build --cache-dir {cache_dir}` first")
    return path
