"""`enroot import` of a freshly built image, made to work with podman and to leave nothing behind.

Enroot 4.1.2 has two traps for us (seen with Enroot + podman on the test cluster):
- after `enroot import podman://TAG` has written the squashfs, its exit trap runs
  `docker rm -f -v NAME`; with no docker it exits 1 and leaks the podman container. A `docker`
  shim (templates/docker_rm_shim.sh) first on PATH turns that into `podman rm`.
- it runs `podman create IMAGE` without a command, which fails for an image with no CMD or
  ENTRYPOINT (a bare Debian base); such images go through our own writer instead.
`uses_enroot` decides (pure); `import_with_enroot` acts.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path

SHIM_TEMPLATE = "docker_rm_shim.sh"


def uses_enroot(image_config: Mapping) -> tuple[bool, str]:
    """(whether `enroot import` can take this image, why not): it needs CMD or ENTRYPOINT."""
    if not (image_config.get("Cmd") or image_config.get("Entrypoint")):
        return False, ("the image has no CMD or ENTRYPOINT, which `enroot import` needs; "
                       "squashing it with our own writer")
    return True, ""


def shim_env(env: Mapping[str, str], shim_dir: Path) -> dict[str, str]:
    """`env` with `shim_dir` (holding our `docker`) first on PATH."""
    out = dict(env)
    out["PATH"] = os.pathsep.join(p for p in (str(shim_dir), env.get("PATH", "")) if p)
    return out


def import_with_enroot(enroot: str, builder: str, tag: str, out: Path, env: Mapping[str, str],
                       run: Callable[[list[str], Mapping[str, str]], object]) -> None:
    """`enroot import -o OUT {podman,dockerd}://TAG`, with the docker shim for podman."""
    scheme = "dockerd" if builder == "docker" else "podman"
    cmd = [enroot, "import", "-o", str(out), f"{scheme}://{tag}"]
    if builder == "docker":
        run(cmd, env)
        return
    with tempfile.TemporaryDirectory(prefix="enn-docker-shim-") as shim_dir:
        shim = Path(shim_dir) / "docker"
        shim.write_text(resources.files("enn_cluster.cluster").joinpath(
            "templates", SHIM_TEMPLATE).read_text("utf-8"))
        shim.chmod(0o755)
        run(cmd, shim_env(env, Path(shim_dir)))
