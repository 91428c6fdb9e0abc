"""Pytest plugin: real Enroot + Pyxis on the local Slurm cluster, and one test image per session.

`pyxis_cluster(squashfuse)` restarts the session's cluster (slurm_fixture) with Pyxis loaded
(`use_squashfuse=0` or `1`) and gives it back without Pyxis at the end of the session.
`test_image` is the squashfs that `enn-submit build` makes from containers/Dockerfile over
the Debian dev base that has our torch (containers/dev/make-base-image.sh), built by the
commands docs/admin.md gives for a site without a registry. Both are cached
outside the repository by content hash (podman storage, ENN_TESTBASE_CACHE and
ENN_TEST_IMAGE_CACHE), so a second session builds nothing; a fresh machine builds them once.

Without ../shared/tools/pyxis-enroot (the Enroot and Pyxis sources) these tests skip, in CI
too: the sources are not part of this repository. With the sources but not as root, or not
installed (`make system-deps`), they skip, or fail under CI=true like the Slurm tests.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enn_cluster.cluster.image import record_path

ROOT = Path(__file__).resolve().parents[1]
PYXIS_SOURCES = Path(os.environ.get("PYXIS_ENROOT_SRC")  # as `make system-deps` takes it
                     or ROOT.parent / "shared" / "tools" / "pyxis-enroot")
PYXIS_PREFIX = Path(os.environ.get("ENN_PYXIS_PREFIX", "/opt/enn-pyxis"))
BASE_CACHE = Path(os.environ.get("ENN_TESTBASE_CACHE", "/var/tmp/enn-testbase-cache"))
IMAGE_CACHE = Path(os.environ.get("ENN_TEST_IMAGE_CACHE", "/var/tmp/enn-test-images"))
# docs/admin.md's offline build names these folders; the session's build uses ours.
DOC_BASE_CACHE, DOC_IMAGE_CACHE = "/var/tmp/enn-base", "/shared/enn/images"
# containers/Dockerfile over a Debian base: torch is already there; nothing from PyPI.
PIP_FLAGS = "--no-deps --no-index --no-build-isolation --break-system-packages"
STALE_IMAGE_S = 2 * 86400  # cached test images unused this long are removed


def _pyxis_missing() -> tuple[str, bool] | None:
    """(why these tests cannot run, whether CI may skip it), or None."""
    if not PYXIS_SOURCES.is_dir():
        return f"no Enroot/Pyxis sources in {PYXIS_SOURCES}", True
    if os.geteuid() != 0:
        return "Pyxis tests need root", False
    if not (PYXIS_PREFIX / "lib" / "slurm" / "spank_pyxis.so").is_file() \
            or shutil.which("enroot") is None:
        return f"Enroot/Pyxis not installed in {PYXIS_PREFIX} (run `make system-deps`)", False
    return _base_missing()


def _base_missing() -> tuple[str, bool] | None:
    """Why the dev base image cannot be built here (never skippable in CI), or None."""
    if os.geteuid() != 0:
        return "building the dev base image needs root", False
    missing = [t for t in ("podman", "debootstrap", "mksquashfs", "unsquashfs")
               if shutil.which(t) is None]
    if missing:
        return f"missing {' '.join(missing)} (run `make system-deps`)", False
    return None


def require_pyxis() -> None:
    """Skip with one line, or fail under CI=true where the sources are present."""
    _skip_or_fail(_pyxis_missing())


def _skip_or_fail(missing: tuple[str, bool] | None) -> None:
    if missing is None:
        return
    reason, ci_may_skip = missing
    if os.environ.get("CI") == "true" and not ci_may_skip:
        pytest.fail(f"Pyxis tests cannot run: {reason} (CI=true: they must)", pytrace=False)
    pytest.skip(reason)


def build_args(base_tag: str) -> dict[str, str]:
    """containers/Dockerfile's build args over the dev base (torch there; nothing from PyPI)."""
    return {"BASE_IMAGE": base_tag, "PIP_INSTALL_FLAGS": PIP_FLAGS}


def build_test_image(cache: Path, tag: str, dockerfile: Path = ROOT / "containers/Dockerfile",
                     env: dict | None = None) -> tuple[Path, str]:
    """`enn-submit build` of `dockerfile` over the dev base `tag` into `cache`: (image, log)."""
    proc = subprocess.run(
        [sys.executable, "-m", "enn_cluster.client.cli", "build", "--cache-dir", str(cache),
         "--dockerfile", str(dockerfile), "--build-arg", f"BASE_IMAGE={tag}",
         "--build-arg", f"PIP_INSTALL_FLAGS={PIP_FLAGS}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env=dict(env or os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1]), proc.stderr


def documented_offline_build(base_cache: Path, image_cache: Path) -> str:
    """docs/admin.md's bash block for a build without a registry, on these cache folders."""
    text = (ROOT / "docs" / "admin.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
                if "make-base-image.sh" in b]
    assert DOC_BASE_CACHE in block and DOC_IMAGE_CACHE in block, block
    return block.replace(DOC_BASE_CACHE, str(base_cache)).replace(DOC_IMAGE_CACHE,
                                                                  str(image_cache))


def _prune_stale(cache: Path, keep: Path) -> None:
    """Images of older sources pile up (one per code change); drop those long unused."""
    now = time.time()
    for old in cache.glob("enn-*.sqsh"):
        if old != keep and now - old.stat().st_atime > STALE_IMAGE_S:
            old.unlink(missing_ok=True)
            record_path(old).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def dev_base_image() -> str:
    """localhost/enn-testbase:KEY: Debian bookworm + our torch (containers/dev)."""
    _skip_or_fail(_base_missing())
    start = time.monotonic()
    base = subprocess.run(["bash", str(ROOT / "containers/dev/make-base-image.sh"),
                           str(BASE_CACHE)], capture_output=True, text=True, timeout=1500)
    assert base.returncode == 0, base.stderr[-3000:]
    tag = base.stdout.strip().splitlines()[-1]
    print(f"\ndev base {tag} ready in {time.monotonic() - start:.1f}s", file=sys.stderr)
    return tag


@pytest.fixture(scope="session")
def test_image_build(dev_base_image) -> tuple[Path, str]:
    """(squashfs of this checkout, the build's stderr): admin.md's offline build, run as
    written (its base script finds `dev_base_image` made). Once per session at most."""
    start = time.monotonic()
    script = documented_offline_build(BASE_CACHE, IMAGE_CACHE)
    env = dict(os.environ, PYTHONPATH=str(ROOT),  # enn-submit: this checkout, this venv
               PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"])))
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    image = Path(proc.stdout.strip().splitlines()[-1])
    print(f"\ntest image {image} ready in {time.monotonic() - start:.1f}s", file=sys.stderr)
    _prune_stale(IMAGE_CACHE, image)
    return image, proc.stderr


@pytest.fixture(scope="session")
def test_image(test_image_build) -> Path:
    """The squashfs of this checkout (built once per session at most; cached by hash)."""
    return test_image_build[0]


@pytest.fixture(scope="session")
def pyxis_cluster(slurm_cluster):
    """A function: pyxis_cluster(squashfuse) -> the session cluster with Pyxis loaded."""
    require_pyxis()

    def with_pyxis(squashfuse: int):
        slurm_cluster.reconfigure(str(squashfuse))
        return slurm_cluster

    yield with_pyxis
    slurm_cluster.reconfigure(None)
