"""What the worker process must hold in its environment at exec, before any library loads.

Why: the dynamic loader reads LD_LIBRARY_PATH once, at exec; NCCL's later `dlopen` of its
net plugin never sees a change made inside the running process. Where an image keeps the
EFA plugin (aws-ofi-nccl) is only known inside the container, so the worker looks there
and re-executes itself once, with the path set, before torch starts (ENN_EXEC_READY marks
the second start). Where the site says EFA (profile `efa`), a missing plugin is an error,
never a silent run over TCP sockets.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from enn_cluster.config import nccl
from enn_cluster.errors import UserError

READY_VAR = "ENN_EXEC_READY"
PLUGIN_DIRS_VAR = "ENN_NCCL_PLUGIN_DIRS"  # colon-separated: where this image keeps the plugin
# The EFA installer puts the plugin in /opt/amazon/ofi-nccl/lib; NGC-derived images (and
# AWS's DLCs) in /opt/amazon/aws-ofi-nccl/lib; a source build's default prefix in the
# AWS samples is /opt/aws-ofi-nccl/lib.
EFA_PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/aws-ofi-nccl/lib",
                   "/opt/aws-ofi-nccl/lib")
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
# aws-ofi-nccl >= 1.7 installs libnccl-net-ofi.so (NCCL_NET_PLUGIN=ofi) and, in most
# releases, a libnccl-net.so link (what NCCL loads when NCCL_NET_PLUGIN is unset).
PLUGIN_LIBRARIES = ("libnccl-net-ofi.so", "libnccl-net-aws-ofi.so", "libnccl-net.so")


@dataclass(frozen=True)
class Plugin:
    directory: str
    library: str  # file name, what NCCL_NET_PLUGIN names


def plugin_search_dirs(environ: Mapping[str, str]) -> tuple[str, ...]:
    """$ENN_NCCL_PLUGIN_DIRS (an image with the plugin elsewhere), else the known places."""
    given = [d for d in environ.get(PLUGIN_DIRS_VAR, "").split(":") if d]
    return tuple(given) or EFA_PLUGIN_DIRS


def find_plugin(dirs: Sequence[str]) -> Optional[Plugin]:
    """The first directory, in order, holding one of the plugin libraries."""
    for directory in dirs:
        for library in PLUGIN_LIBRARIES:
            if os.path.isfile(os.path.join(directory, library)):
                return Plugin(directory, library)
    return None


def wanted_fabric(environ: Mapping[str, str], sysfs_root: str = "/sys") -> tuple[str, bool]:
    """(fabric, pinned): pinned when the profile names EFA outright (site or flag)."""
    profile = nccl.check_profile(environ.get(nccl.PROFILE_VAR) or "auto", nccl.PROFILE_VAR)
    if profile == "auto":
        return nccl.detect_fabric(sysfs_root, environ), False
    return profile, profile == "efa"


def exec_env(environ: Mapping[str, str], fabric: str, pinned: bool, plugin: Optional[Plugin],
             libfabric_dirs: Sequence[str] = ()) -> dict[str, str]:
    """The variables to change before exec (pure). EFA: the plugin's directory and the
    libfabric directories go first in LD_LIBRARY_PATH (the user's entries kept, in order),
    and NCCL_NET_PLUGIN names the library found unless the user set it."""
    if fabric != "efa":
        return {}
    if plugin is None:
        if pinned:
            raise UserError(
                f"{nccl.PROFILE_VAR}=efa: no NCCL net plugin ({', '.join(PLUGIN_LIBRARIES)}) "
                f"in {', '.join(plugin_search_dirs(environ))}; install aws-ofi-nccl in the "
                f"image or name its lib directory in {PLUGIN_DIRS_VAR}")
        return {}
    parts = [p for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    front = [d for d in (plugin.directory, *libfabric_dirs) if d not in parts]
    out = {"LD_LIBRARY_PATH": ":".join(front + parts)} if front else {}
    if "NCCL_NET_PLUGIN" not in environ:
        out["NCCL_NET_PLUGIN"] = plugin.library
    return out


def can_reexec(orig_argv: Sequence[str]) -> bool:
    """A multiprocessing 'spawn' child (the local launcher's workers) cannot be re-executed:
    its start-up data came through a pipe that is already read. Its environment is the
    parent's at spawn time, so the parent must set the path before it spawns."""
    return "--multiprocessing-fork" not in orig_argv


def reexec_if_needed(environ: Optional[Mapping[str, str]] = None) -> None:
    """Re-execute this very command line once when the exec environment must change."""
    environ = dict(os.environ if environ is None else environ)
    if environ.get(READY_VAR) or not can_reexec(sys.orig_argv):
        return
    fabric, pinned = wanted_fabric(environ)
    plugin = find_plugin(plugin_search_dirs(environ)) if fabric == "efa" else None
    present = [d for d in LIBFABRIC_DIRS if os.path.isdir(d)]
    changes = exec_env(environ, fabric, pinned, plugin, present)
    if not changes:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**environ, **changes, READY_VAR: "1"})
