"""Build the job image once: Dockerfile -> container image -> Enroot squashfs in an image cache.

Every node of a job starts its container from one prebuilt `.sqsh` on the shared filesystem
(Pyxis `--container-image=/path/enn-<key>.sqsh`) instead of pulling and converting an image
per node. The file is named by `image_key` (a content hash of what the build sees), and
appears under that name only when complete.

The pure part (the builder's environment) returns data; the acting parts (podman/docker,
tar, mksquashfs, enroot) are kept thin. Never imports torch.
"""
from __future__ import annotations

import json
import os
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
from enn_cluster.cluster.image_key import image_key, image_path
from enn_cluster.errors import ToolMissing, UserError
from enn_cluster.storage.run_files import read_run_text
from enn_cluster.storage.output_target import missing_parents, remove_empty

TAG_REPO = "localhost/enn-cluster"
OWN_WRITER, ENROOT_IMPORT = "our own writer", "enroot import"  # the two ways to a squashfs
SQUASH_OPTIONS = ("-comp", "zstd", "-Xcompression-level", "3")  # ~15x faster than zstd -15
ENROOT_SQUASH_OPTIONS = "-comp zstd -Xcompression-level 3"
_REPO_CONTAINERS_CONF = Path(__file__).resolve().parents[2] / "containers" / "containers.conf"

Progress = Callable[[str], None]


class ImageBuildError(UserError):
    """A build step (podman/docker, tar, mksquashfs, enroot) failed; the message says which."""


# ------------------------------------------------------------------ pure: build environment

def builder_env(builder: str, environ: Mapping[str, str], containers_conf: Path | None) -> dict:
    """Environment for builder and enroot calls: our podman settings unless the user has own."""
    env = dict(environ)
    if builder == "podman" and containers_conf is not None and not env.get("CONTAINERS_CONF"):
        env["CONTAINERS_CONF"] = str(containers_conf)
    env.setdefault("ENROOT_SQUASH_OPTIONS", ENROOT_SQUASH_OPTIONS)
    return env


def size_text(n: int) -> str:
    """An image's size as people read it (decimal units, like `ls --si`): 416 MB, 1.2 GB."""
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 10**6 else f"{n} bytes"


def final_line(image: Path, size: int, writer: str | None, seconds: float | None = None) -> str:
    """The build's last line: the image, its size, which path made it (and the time, if now)."""
    made = f"made by {writer}" if writer else "how it was made is not recorded"
    if seconds is None:
        return f"enn build: up to date: {image} ({size_text(size)}, {made})"
    return f"enn build: wrote {image} ({size_text(size)}, {made}, {seconds:.1f}s in all)"


def record_path(image: Path) -> Path:
    """Beside the image: how it was made, for the line of a later build that finds it."""
    return image.with_name(image.name + ".json")


def read_record(image: Path) -> str | None:
    """The writer recorded for `image`; None for an image without (or with a bad) record.
    The image cache is shared: the record is read as a run file is (a regular file, not a
    link, bounded), so a FIFO or a huge file in its place cannot hang or flood a build."""
    try:
        record = json.loads(read_run_text(record_path(image), limit=4096))
    except (OSError, ValueError, UserError):
        return None
    writer = record.get("writer") if isinstance(record, dict) else None
    return writer if writer in (OWN_WRITER, ENROOT_IMPORT) else None


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


def _export_rootfs(builder: str, tag: str, rootfs: Path, env: Mapping[str, str],
                   say: Progress) -> None:
    """Flattened rootfs of `tag` in `rootfs`, without /dev/* and /.dockerenv (as Enroot)."""
    name = f"enn-export-{secrets.token_hex(6)}"
    # A command is given because images without CMD/ENTRYPOINT cannot be created; never run.
    _run([builder, "create", "--name", name, tag, "/bin/true"], env)
    try:
        with _stage(say, "export rootfs"):
            _pipe([builder, "export", name],
                  ["tar", "-C", str(rootfs), "--warning=no-timestamp", "--numeric-owner",
                   *enroot_layout.tar_excludes(), "-px", "-f", "-"], env)
    finally:
        with _stage(say, f"{builder} rm (the export container)"):
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
        _export_rootfs(tools.builder, tag, rootfs, env, say)
        with _stage(say, "write Enroot files"):
            config = _inspect_config(tools.builder, tag, env)
            enroot_layout.apply_layout(rootfs, config, f"{tools.builder}://{tag}")
        with _stage(say, "mksquashfs (zstd -3)"):
            _run([tools.mksquashfs, str(rootfs), str(out), "-noappend", "-all-root",
                  *SQUASH_OPTIONS, "-no-progress", "-quiet"], env)
    finally:
        with _stage(say, "remove rootfs"):  # a big image's rootfs takes a minute or more
            subprocess.run(["chmod", "-R", "u+rwX", str(workdir)], capture_output=True)
            shutil.rmtree(workdir, ignore_errors=True)


def _to_squashfs(tools: _Tools, tag: str, out: Path, env: Mapping[str, str],
                 say: Progress) -> str:
    """`enroot import` where it can take the image, else our own writer (same layout).

    Returns which of the two made `out` (ENROOT_IMPORT or OWN_WRITER)."""
    use_enroot = False
    if tools.enroot:
        with _stage(say, "inspect image config"):
            config = _inspect_config(tools.builder, tag, env)
        use_enroot, why = enroot_import.uses_enroot(config)
        if not use_enroot:
            say(f"enn build: {why}")
    if use_enroot:
        with _stage(say, "enroot import"):
            enroot_import.import_with_enroot(tools.enroot, tools.builder, tag, out, env, _run)
        return ENROOT_IMPORT
    _squash_image(tools, tag, out, env, say)
    return OWN_WRITER


def _write_record(image: Path, writer: str) -> None:
    """record_path(image), written whole (a temporary file renamed into place)."""
    path = record_path(image)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    tmp.write_text(json.dumps({"writer": writer}) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def build_image(dockerfile: str | os.PathLike, context: str | os.PathLike,
                cache_dir: str | os.PathLike, *, build_args: Mapping[str, str] | None = None,
                builder: str | None = None, progress: Progress | None = None) -> Path:
    """Build `dockerfile` on `context` into `<cache_dir>/enn-<key>.sqsh` and return its path.

    Returns at once when that file exists. `builder` is "podman" or "docker" (default: the
    first installed). Uses `enroot import` when enroot is installed, else makes the same
    layout itself. `progress` gets one timed line per stage (cleanup included), the builder's
    output, and a last line with the image, its size and which path made it (default:
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
        say(final_line(final, final.stat().st_size, read_record(final)))
        return final
    writer = _build(_pick_tools(builder), dockerfile, context, final, build_args, say)
    say(final_line(final, final.stat().st_size, writer, time.monotonic() - start))
    return final


def _build(tools: _Tools, dockerfile: Path, context: Path, final: Path,
           build_args: Mapping[str, str] | None, say: Progress) -> str:
    """Builder image -> squashfs `final`, then its tag removed; which path made it."""
    made = missing_parents(final)  # the cache folders this build creates
    final.parent.mkdir(parents=True, exist_ok=True)
    env = builder_env(tools.builder, os.environ, _containers_conf(context))
    token = secrets.token_hex(4)
    tag = f"{TAG_REPO}:{final.stem[4:]}-{token}"
    partial = final.with_name(f".{final.name}.{token}.partial")
    built = False
    try:
        with _stage(say, f"{tools.builder} build"):
            args = [f"--build-arg={k}={v}" for k, v in sorted((build_args or {}).items())]
            _run_streaming([tools.builder, "build", "--force-rm", "-f", str(dockerfile),
                            "-t", tag, *args, str(context)], env, say)
        writer = _to_squashfs(tools, tag, partial, env, say)
        _write_record(final, writer)
        os.replace(partial, final)
        built = True
    finally:
        partial.unlink(missing_ok=True)
        if not built:
            if not final.exists():
                record_path(final).unlink(missing_ok=True)
            remove_empty(made)  # a failed build leaves no empty --cache-dir behind
        # -f: also the containers made from it (an import that died half-way leaves one).
        with _stage(say, f"{tools.builder} rmi (the build's image)"):
            subprocess.run([tools.builder, "rmi", "-f", tag], env=env, capture_output=True)
    return writer
