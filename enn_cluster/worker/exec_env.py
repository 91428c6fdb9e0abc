"""What the worker process must hold in its environment at exec, before any library loads.

Why: the dynamic loader reads LD_LIBRARY_PATH once, at exec; NCCL's later `dlopen` of its
net plugin never sees a change made inside the running process. Where an image keeps the
EFA plugin (aws-ofi-nccl) is only known inside the container, so the worker looks there
and re-executes itself once, with the path set, before torch starts (ENN_EXEC_READY marks
the second start). Where the site says EFA (profile `efa`), a missing plugin is an error,
and NCCL_NET makes one that fails to load an error in NCCL: never a silent run over TCP
sockets. With `auto`, a node showing EFA but no plugin says so in one warning line.
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from enn_cluster.config import nccl
from enn_cluster.errors import UserError

READY_VAR = "ENN_EXEC_READY"
PLUGIN_DIRS_VAR = "ENN_NCCL_PLUGIN_DIRS"  # colon-separated: where this image keeps the plugin
# The EFA installer puts the plugin in /opt/amazon/ofi-nccl/lib; NGC-derived images (and
# AWS's DLCs) in /opt/amazon/aws-ofi-nccl/lib; a source build's default prefix in the
# AWS samples is /opt/aws-ofi-nccl/lib. Recent EFA installers use the Debian multiarch
# subdirectory, /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu (awslabs/awsome-distributed-ai#935;
# aarch64-linux-gnu on Graviton/GB200), searched first.
EFA_PLUGIN_DIRS = (f"/opt/amazon/ofi-nccl/lib/{platform.machine()}-linux-gnu",
                   "/opt/amazon/ofi-nccl/lib", "/opt/amazon/aws-ofi-nccl/lib",
                   "/opt/aws-ofi-nccl/lib")
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
# aws-ofi-nccl >= 1.7 installs libnccl-net-ofi.so (NCCL_NET_PLUGIN=ofi) and, in most
# releases, a libnccl-net.so link (what NCCL loads when NCCL_NET_PLUGIN is unset).
PLUGIN_LIBRARIES = ("libnccl-net-ofi.so", "libnccl-net-aws-ofi.so", "libnccl-net.so")
DEFAULT_LIBRARY = "libnccl-net.so"
# NCCL_NET_PLUGIN takes the suffix: older NCCL only opens libnccl-net-<value>.so (its docs:
# "Suffix string of the plugin file name"; src/net.cc snprintf "libnccl-net-%s.so"), so a
# file name becomes libnccl-net-libnccl-net-ofi.so.so: not found, internal net, TCP. Newer
# NCCL tries the value as a file name first, then the same pattern
# (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-net-plugin).
# Either way a plugin that fails to load falls back to the internal IB/Socket net, silently.
# NCCL_NET makes that an error ("Error: network ... not found", ncclInvalidUsage; env.html
# #nccl-net, since 2.10). "AWS Libfabric" is the one name every aws-ofi-nccl answers to:
# <= 1.11 registers it, later releases register "Libfabric" but take this name back when
# NCCL_NET asks for it (aws/aws-ofi-nccl#530, src/nccl_ofi_interface_nvidia.c).
EFA_NET = "AWS Libfabric"
# A site that accepts NCCL over TCP sockets on a fabric node (e.g. while it installs the
# plugin) says so here; otherwise such a mismatch stops the job (exit 2).
FALLBACK_VAR = "ENN_ALLOW_SOCKET_FALLBACK"
log = logging.getLogger(__name__)


def fallback_allowed(environ: Mapping[str, str]) -> bool:
    return environ.get(FALLBACK_VAR, "") in ("1", "true", "yes")


@dataclass(frozen=True)
class Plugin:
    directory: str
    library: str  # file name: libnccl-net.so or libnccl-net-<suffix>.so

    @property
    def suffix(self) -> Optional[str]:
        """What NCCL_NET_PLUGIN names; None for libnccl-net.so, NCCL's default name."""
        if self.library == DEFAULT_LIBRARY:
            return None
        return self.library[len("libnccl-net-"):-len(".so")]


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
             libfabric_dirs: Sequence[str] = (), exists=os.path.isfile) -> dict:
    """The variables to change before exec (pure but for warnings; None: unset it). EFA:
    the plugin's directory and the libfabric directories go first in LD_LIBRARY_PATH (the
    user's entries kept, in order), NCCL_NET_PLUGIN names the plugin found, replacing an
    inherited value that names no library there (newer NVIDIA images set their own plugin:
    NCCL would load it or none, and run over TCP), and NCCL_NET makes a plugin that fails
    to load an error in NCCL. No plugin on an EFA node is an error naming the fix, unless
    ENN_ALLOW_SOCKET_FALLBACK (site.allow_socket_fallback) accepts TCP sockets."""
    if fabric != "efa":
        return {}
    if plugin is None:
        missing = (f"no NCCL net plugin ({', '.join(PLUGIN_LIBRARIES)}) in "
                   f"{', '.join(plugin_search_dirs(environ))}")
        fix = (f"install aws-ofi-nccl in the image (containers/Dockerfile with --build-arg "
               f"EFA_INSTALLER_VERSION=...) or name its lib directory in {PLUGIN_DIRS_VAR}")
        if pinned or not fallback_allowed(environ):
            raise UserError(f"{nccl.PROFILE_VAR}={'efa' if pinned else 'auto'} on an EFA "
                            f"node: {missing}; {fix}")
        log.warning("EFA detected (%s=auto) but %s: NCCL will run over TCP sockets (%s=1); "
                    "%s", nccl.PROFILE_VAR, missing, FALLBACK_VAR, fix)
        return {}
    parts = [p for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    front = [d for d in (plugin.directory, *libfabric_dirs) if d not in parts]
    out: dict = {"LD_LIBRARY_PATH": ":".join(front + parts)} if front else {}
    named = environ.get("NCCL_NET_PLUGIN")
    if named is not None and not _names_library(named, plugin.directory, exists):
        log.warning("NCCL_NET_PLUGIN=%s (from the image or the job) names no library in %s: "
                    "replaced by aws-ofi-nccl's %s on this EFA node", named, plugin.directory,
                    plugin.library)
        out["NCCL_NET_PLUGIN"] = plugin.suffix  # None: unset, NCCL opens libnccl-net.so
    elif named is None and plugin.suffix:
        out["NCCL_NET_PLUGIN"] = plugin.suffix
    if "NCCL_NET" not in environ:
        out["NCCL_NET"] = EFA_NET
    return out


def _names_library(value: str, directory: str, exists) -> bool:
    """Whether NCCL_NET_PLUGIN=value opens a library in `directory`: a file name (newer
    NCCL) or the suffix of libnccl-net-<value>.so."""
    return any(exists(os.path.join(directory, name))
               for name in (os.path.basename(value), f"libnccl-net-{value}.so"))


ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
CACHE_VARS = ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
SCRATCH_FALLBACKS = ("/tmp", "/dev/shm", "/var/tmp")  # an Enroot container: /tmp is a tmpfs


def process_defaults(environ: Mapping[str, str], home_usable=None,
                     uid: Optional[int] = None) -> dict[str, str]:
    """Variables the worker sets for itself before torch touches the GPU (the user's are
    kept). PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: fewer fragmentation OOMs at
    the same peak (unless the allocator is configured either way). Where HOME does not
    exist or cannot be written (`srun --no-container-mount-home` keeps the host's HOME, which
    the image lacks), HOME and the XDG, triton and inductor caches go to node-local
    scratch ($TMPDIR or /tmp, enn-cache-UID): triton, inductor and Hugging Face write
    under ~/.cache and would fail. A TMPDIR that is not a writable directory here (a site's
    per-job host path that the container's read-only root lacks) is replaced by the first
    of SCRATCH_FALLBACKS that is, before anything writes a temporary file."""
    out = {}
    if not {ALLOC_CONF[0], "PYTORCH_ALLOC_CONF"} & set(environ):
        out[ALLOC_CONF[0]] = ALLOC_CONF[1]
    home = environ.get("HOME", "")
    usable = home_usable or (lambda path: bool(path) and os.path.isdir(path)
                             and os.access(path, os.W_OK))
    tmp = environ.get("TMPDIR") or ""
    if tmp and not usable(tmp):
        tmp = out["TMPDIR"] = next((d for d in SCRATCH_FALLBACKS if usable(d)),
                                   SCRATCH_FALLBACKS[0])
    if not usable(home):
        scratch = os.path.join(tmp or SCRATCH_FALLBACKS[0],
                               f"enn-cache-{os.getuid() if uid is None else uid}")
        out["HOME"] = scratch
        for name, sub in zip(CACHE_VARS, ("xdg", "triton", "inductor")):
            if name not in environ:
                out[name] = os.path.join(scratch, sub)
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
    merged = {k: v for k, v in {**environ, **changes}.items() if v is not None}
    os.execve(sys.executable, list(sys.orig_argv), {**merged, READY_VAR: "1"})
