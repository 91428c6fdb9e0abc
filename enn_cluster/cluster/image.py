"""Build the job image once: Dockerfile -> container image -> Enroot squashfs in an image cache.

Every node of a job starts its container from one prebuilt `.sqsh` on the shared filesystem
(Pyxis `--container-image=/path/enn-<key>.sqsh`) instead of pulling and converting an image
per node. The file name is a content hash of the Dockerfile, the build context the builder
can see (after .dockerignore) and the build args, so an unchanged tree never rebuilds and a
changed one can never be served a stale image.

Pure parts (ignore rules, key, paths, environment) return data; the acting parts (walking the
context, podman/docker, tar, mksquashfs, enroot) are kept thin. Never imports torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from enn_cluster.cluster import enroot_import, enroot_layout
from enn_cluster.errors import ToolMissing, UserError

KEY_FORMAT = "enn-image/1"  # bump when the image layout we produce changes
TAG_REPO = "localhost/enn-cluster"
SQUASH_OPTIONS = ("-comp", "zstd", "-Xcompression-level", "3")  # ~15x faster than zstd -15
ENROOT_SQUASH_OPTIONS = "-comp zstd -Xcompression-level 3"
_REPO_CONTAINERS_CONF = Path(__file__).resolve().parents[2] / "containers" / "containers.conf"

Progress = Callable[[str], None]


class ImageBuildError(UserError):
    """A build step (podman/docker, tar, mksquashfs, enroot) failed; the message says which."""


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


def builder_env(builder: str, environ: Mapping[str, str], containers_conf: Path | None) -> dict:
    """Environment for builder and enroot calls: our podman settings unless the user has own."""
    env = dict(environ)
    if builder == "podman" and containers_conf is not None and not env.get("CONTAINERS_CONF"):
        env["CONTAINERS_CONF"] = str(containers_conf)
    env.setdefault("ENROOT_SQUASH_OPTIONS", ENROOT_SQUASH_OPTIONS)
    return env


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


# ---------------------------------------------------------------------------- acting: build

@dataclass(frozen=True)
class _Tools:
    builder: str  # "podman" or "docker"
    enroot: str | None
    mksquashfs: str | None


def _pick_tools(builder: str | None) -> _Tools:
    """The programs this build will run; ToolMissing before any slow step when one is absent."""
    if builder not in (None, "podman", "docker"):
        raise UserError(f"builder must be podman or docker, not {builder!r}")
    names = [builder] if builder else ["podman", "docker"]
    found = next((name for name in names if shutil.which(name)), None)
    if found is None:
        what = builder or "podman or docker"
        raise ToolMissing(f"{what} not found: apt-get install {builder or 'podman'}")
    enroot, mksquashfs = shutil.which("enroot"), shutil.which("mksquashfs")
    if enroot is None and mksquashfs is None:
        raise ToolMissing("mksquashfs not found (and no enroot): apt-get install squashfs-tools")
    return _Tools(found, enroot, mksquashfs)


def _containers_conf(context: Path) -> Path | None:
    """Our containers.conf (this checkout's, else the context's) if runc, which it sets, exists."""
    runc = shutil.which("runc", path=os.pathsep.join(
        [os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/usr/local/bin"]))
    candidates = (_REPO_CONTAINERS_CONF, context / "containers" / "containers.conf")
    return next((conf for conf in candidates if runc and conf.is_file()), None)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _stage(say: Progress, what: str) -> Iterator[None]:
    """One progress line per finished stage, with its wall time."""
    start = time.monotonic()
    yield
    say(f"enn build: {what} ({time.monotonic() - start:.1f}s)")


def _failure(cmd: list[str], returncode: int, output: str | bytes) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    last = (output.strip().splitlines() or ["(no output)"])[-1]
    return f"`{' '.join(cmd[:2])}` failed (exit {returncode}): {last}"


def _run(cmd: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess:
    """Run a short command; ImageBuildError with its last stderr line when it fails."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise ImageBuildError(_failure(cmd, proc.returncode, proc.stderr))
    return proc


def _run_streaming(cmd: list[str], env: Mapping[str, str], say: Progress) -> None:
    """Run a long command (the image build), passing its output lines on as they come."""
    tail: deque[str] = deque(maxlen=1)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc:
        for line in proc.stdout:
            if line.strip():
                tail.append(line.rstrip())
                say("  " + line.rstrip())
    if proc.returncode != 0:
        raise ImageBuildError(_failure(cmd, proc.returncode, "".join(tail)))


def _pipe(first: list[str], second: list[str], env: Mapping[str, str]) -> None:
    """`first | second` without a shell; ImageBuildError naming each side that failed."""
    with tempfile.TemporaryFile() as first_err:
        proc = subprocess.Popen(first, env=env, stdout=subprocess.PIPE, stderr=first_err)
        try:
            done = subprocess.run(second, env=env, stdin=proc.stdout, capture_output=True)
        finally:
            proc.stdout.close()
            proc.wait()
        first_err.seek(0)
        failures = [_failure(cmd, rc, err) for cmd, rc, err in (
            (first, proc.returncode, first_err.read()), (second, done.returncode, done.stderr))
            if rc != 0]
    if failures:
        raise ImageBuildError("; ".join(failures))


def _export_rootfs(builder: str, tag: str, rootfs: Path, env: Mapping[str, str]) -> None:
    """Flattened rootfs of `tag` in `rootfs`, without /dev/* and /.dockerenv (as Enroot)."""
    name = f"enn-export-{secrets.token_hex(6)}"
    # A command is given because images without CMD/ENTRYPOINT cannot be created; never run.
    _run([builder, "create", "--name", name, tag, "/bin/true"], env)
    try:
        _pipe([builder, "export", name],
              ["tar", "-C", str(rootfs), "--warning=no-timestamp", "--numeric-owner",
               *enroot_layout.tar_excludes(), "-px", "-f", "-"], env)
    finally:
        subprocess.run([builder, "rm", "-f", name], env=env, capture_output=True)


def _inspect_config(builder: str, tag: str, env: Mapping[str, str]) -> dict:
    """The image's config (ENV, CMD, WORKDIR, ...) from `podman/docker image inspect`."""
    inspect = json.loads(_run([builder, "image", "inspect", tag], env).stdout)
    return enroot_layout.image_config(inspect[0])


def _squash_image(tools: _Tools, tag: str, out: Path, env: Mapping[str, str],
                  say: Progress) -> None:
    """Without Enroot: export the rootfs, add Enroot's files, mksquashfs it into `out`."""
    workdir = Path(tempfile.mkdtemp(prefix="enn-rootfs-"))
    rootfs = workdir / "rootfs"
    rootfs.mkdir()
    try:
        with _stage(say, "export rootfs"):
            _export_rootfs(tools.builder, tag, rootfs, env)
        with _stage(say, "write Enroot files"):
            config = _inspect_config(tools.builder, tag, env)
            enroot_layout.apply_layout(rootfs, config, f"{tools.builder}://{tag}")
        with _stage(say, "mksquashfs (zstd -3)"):
            _run([tools.mksquashfs, str(rootfs), str(out), "-noappend", "-all-root",
                  *SQUASH_OPTIONS, "-no-progress", "-quiet"], env)
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(workdir)], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _to_squashfs(tools: _Tools, tag: str, out: Path, env: Mapping[str, str],
                 say: Progress) -> None:
    """`enroot import` where it can take the image, else our own writer (same layout)."""
    use_enroot = False
    if tools.enroot:
        use_enroot, why = enroot_import.uses_enroot(_inspect_config(tools.builder, tag, env))
        if not use_enroot:
            say(f"enn build: {why}")
    if use_enroot:
        with _stage(say, "enroot import"):
            enroot_import.import_with_enroot(tools.enroot, tools.builder, tag, out, env, _run)
    else:
        _squash_image(tools, tag, out, env, say)


def build_image(dockerfile: str | os.PathLike, context: str | os.PathLike,
                cache_dir: str | os.PathLike, *, build_args: Mapping[str, str] | None = None,
                builder: str | None = None, progress: Progress | None = None) -> Path:
    """Build `dockerfile` on `context` into `<cache_dir>/enn-<key>.sqsh` and return its path.

    Returns at once when that file exists. `builder` is "podman" or "docker" (default: the
    first installed). Uses `enroot import` when enroot is installed, else makes the same
    layout itself. `progress` gets one line per stage and the builder's output (default:
    stderr). The squashfs appears under its final name only when complete.
    """
    say = progress or _stderr_line
    dockerfile, context = Path(dockerfile), Path(context)
    if not dockerfile.is_file():
        raise UserError(f"Dockerfile not found: {dockerfile}")
    if not context.is_dir():
        raise UserError(f"build context is not a directory: {context}")
    start = time.monotonic()
    with _stage(say, "hash build context"):
        key = image_key(dockerfile, context, build_args)
    final = image_path(cache_dir, key)
    if final.is_file():
        say(f"enn build: up to date: {final}")
        return final
    tools = _pick_tools(builder)
    final.parent.mkdir(parents=True, exist_ok=True)
    env = builder_env(tools.builder, os.environ, _containers_conf(context))
    token = secrets.token_hex(4)
    tag = f"{TAG_REPO}:{key[:16]}-{token}"
    partial = final.with_name(f".{final.name}.{token}.partial")
    try:
        with _stage(say, f"{tools.builder} build"):
            args = [f"--build-arg={k}={v}" for k, v in sorted((build_args or {}).items())]
            _run_streaming([tools.builder, "build", "--force-rm", "-f", str(dockerfile),
                            "-t", tag, *args, str(context)], env, say)
        _to_squashfs(tools, tag, partial, env, say)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
        # -f: also the containers made from it (an import that died half-way leaves one).
        subprocess.run([tools.builder, "rmi", "-f", tag], env=env, capture_output=True)
    say(f"enn build: wrote {final} ({time.monotonic() - start:.1f}s)")
    return final
