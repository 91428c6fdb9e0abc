"""Which network interface carries the control plane: gloo's sockets and NCCL's bootstrap.

Why: without GLOO_SOCKET_IFNAME gloo takes the address the hostname resolves to (127.0.1.1
where /etc/hosts maps it there, and Enroot mounts the host's file); an exclusion list in
NCCL_SOCKET_IFNAME lets bootstrap land on a storage or BMC NIC that does not route between
nodes. One choice, used for both: the site's (ENN_SOCKET_IFNAME), else the interface the
kernel routes MASTER_ADDR through (/proc/net/route, longest prefix). With neither, nothing
is set and NCCL picks (it skips lo and docker*, prefers ib*). A job whose ranks run on more
than one machine (host and network namespace, told apart in the rendezvous store) and whose
choice is `lo` stops at once: its peers could never connect. Ranks on one machine (two
torchrun agents on a laptop) and a site that names lo itself are fine. Pure but `apply`.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Mapping, MutableMapping, Optional

from enn_cluster.worker.environment import WorkerEnv

SITE_VAR = "ENN_SOCKET_IFNAME"
RTF_UP = 0x1  # route flags, include/uapi/linux/route.h


def _le_ip(hex_text: str) -> int:
    """/proc/net/route writes addresses as host-order (little-endian) hex."""
    return int.from_bytes(bytes.fromhex(hex_text), "little")


def route_interface(route_table: str, destination: str) -> Optional[str]:
    """The interface of the best route to `destination` (an IPv4 address) in the text of
    /proc/net/route (the main table: longest prefix, then lowest metric); 'lo' for a
    loopback address; None when no route matches or the address is not IPv4."""
    try:
        dest = ipaddress.IPv4Address(destination)
    except ValueError:
        return None
    if dest.is_loopback:
        return "lo"
    best: Optional[tuple[int, int, str]] = None
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        iface, net, flags, metric, mask = fields[0], fields[1], fields[3], fields[6], fields[7]
        if not int(flags, 16) & RTF_UP:
            continue
        net_i, mask_i = _le_ip(net), _le_ip(mask)
        if int(dest) & mask_i != net_i:
            continue
        key = (bin(mask_i).count("1"), -int(metric), iface)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def control_env(environ: Mapping[str, str], routed: Optional[str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming one interface, for the names the
    environment does not set yet. The choice, in order: ENN_SOCKET_IFNAME (site), the
    user's exact GLOO_SOCKET_IFNAME or '=name' NCCL_SOCKET_IFNAME (so both agree), the
    interface routed to MASTER_ADDR (`routed`). Nothing when none of them names one: NCCL's
    own choice then beats an exclusion list (env.html#nccl-socket-ifname)."""
    nccl_user = environ.get("NCCL_SOCKET_IFNAME", "")
    choice = (environ.get(SITE_VAR) or environ.get("GLOO_SOCKET_IFNAME")
              or (nccl_user[1:] if nccl_user.startswith("=") else None) or routed)
    if not choice:
        return {}
    values = {"GLOO_SOCKET_IFNAME": choice, "NCCL_SOCKET_IFNAME": "=" + choice}
    return {k: v for k, v in values.items() if k not in environ}


def machines(env: WorkerEnv) -> int:
    """How many machines the world may span, as the launcher says: the local launcher's
    nodes share this one; torchrun's or Slurm's nodes may still be one machine (two agents
    on a laptop), which only the ranks' own hosts tell (loopback_refusal)."""
    return 1 if env.launcher == "local" else env.num_nodes


def host_identity() -> str:
    """What loopback reaches: this machine (its boot) and network namespace. Two Slurm
    'nodes' in their own namespaces on one machine differ; two agents in one do not."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        boot, netns = "?", "?"
    return f"{socket.gethostname()}/{boot}/{netns}"


def peer_post(environ: Mapping[str, str]) -> str:
    """What this rank tells its peers before any process group (after `apply`): its host,
    whether it would talk over lo without the site having said so, and why."""
    chosen = environ.get("GLOO_SOCKET_IFNAME", "")
    site = environ.get(SITE_VAR, "")
    on_lo = "lo" in chosen.split(",") and "lo" not in site.split(",")
    master = environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = socket.gethostbyname(master) if on_lo else master
    except OSError:
        address = master
    return json.dumps([host_identity(), on_lo, master, address])


def loopback_refusal(posts: list[str]) -> str:
    """Rank 0's judgement over every rank's peer_post: the loopback error when a rank
    would talk over lo while the ranks run on more than one machine, else ''."""
    seen = [json.loads(p) for p in posts]
    hosts = len({host for host, *_ in seen})
    for _, on_lo, master, address in seen:
        if on_lo:
            return loopback_error("lo", hosts, master, address) or ""
    return ""


def loopback_error(interface: Optional[str], hosts: int, master: str,
                   address: str) -> Optional[str]:
    """The one-line error for a job spanning `hosts` machines whose control interface is
    the loopback: peers on other machines cannot reach it. None when the choice is fine."""
    if hosts <= 1 or not interface or "lo" not in interface.split(","):
        return None
    return (f"control plane: this job spans {hosts} machines but would talk over the loopback "
            f"interface lo (MASTER_ADDR {master} resolves to {address}, e.g. the hostname's "
            f"127.0.1.1 line in /etc/hosts); set the site's socket_ifname ({SITE_VAR}) to the "
            "interface that reaches the other nodes, or map the hostname to that address in "
            "/etc/hosts")


def apply(environ: MutableMapping[str, str], route_path: str = "/proc/net/route") -> str:
    """Set the control interface in `environ` (the worker, before any process group);
    returns a log line saying what was chosen and why. Whether `lo` is wrong is decided
    once the ranks have met in the store (peer_post, loopback_refusal): only when they
    run on more than one machine, and never when the site chose lo (ENN_SOCKET_IFNAME)."""
    master = environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = socket.gethostbyname(master)
        with open(route_path, encoding="ascii") as fh:
            routed = route_interface(fh.read(), address)
    except (OSError, UnicodeDecodeError):
        address, routed = master, None
    environ.update(control_env(environ, routed))
    return (f"control plane: MASTER_ADDR {master} ({address}) routed via {routed or '?'}; "
            f"GLOO_SOCKET_IFNAME={environ.get('GLOO_SOCKET_IFNAME', '(unset)')} "
            f"NCCL_SOCKET_IFNAME={environ.get('NCCL_SOCKET_IFNAME', '(unset)')} "
            f"{SITE_VAR}={environ.get(SITE_VAR, '(unset)')} pid {os.getpid()}")
