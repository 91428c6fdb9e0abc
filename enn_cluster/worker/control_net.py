"""Which network interface carries the control plane: gloo's sockets and NCCL's bootstrap.

Why: without GLOO_SOCKET_IFNAME gloo takes the address the hostname resolves to (127.0.1.1
where /etc/hosts maps it there, and Enroot mounts the host's file); an exclusion list in
NCCL_SOCKET_IFNAME lets bootstrap land on a storage or BMC NIC that does not route between
nodes. One choice, used for both: the site's (ENN_SOCKET_IFNAME), else the interface the
kernel routes MASTER_ADDR through (/proc/net/route, longest prefix). With neither, nothing
is set and NCCL picks (it skips lo and docker*, prefers ib*). A job spanning machines whose
choice is `lo` stops at once: its peers could never connect. Pure but `apply`.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping, MutableMapping, Optional

from enn_cluster.errors import UserError
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
    """How many machines the world spans: the local launcher's nodes share this one."""
    return 1 if env.launcher == "local" else env.num_nodes


def loopback_error(interface: Optional[str], hosts: int, master: str,
                   address: str) -> Optional[str]:
    """The one-line error for a job spanning `hosts` machines whose control interface is
    the loopback: peers on other machines cannot reach it. None when the choice is fine."""
    if hosts <= 1 or not interface or "lo" not in interface.split(","):
        return None
    return (f"control plane: this {hosts}-node job would talk over the loopback interface lo "
            f"(MASTER_ADDR {master} resolves to {address}, e.g. the hostname's 127.0.1.1 line "
            f"in /etc/hosts); set the site's socket_ifname ({SITE_VAR}) to the interface that "
            "reaches the other nodes, or map the hostname to that address in /etc/hosts")


def apply(environ: MutableMapping[str, str], route_path: str = "/proc/net/route", *,
          env: Optional[WorkerEnv] = None) -> str:
    """Set the control interface in `environ` (the worker, before any process group);
    returns a log line saying what was chosen and why. Given the worker's `env`, a
    multi-machine job whose choice is `lo` is a UserError (exit 2)."""
    master = environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = socket.gethostbyname(master)
        with open(route_path, encoding="ascii") as fh:
            routed = route_interface(fh.read(), address)
    except (OSError, UnicodeDecodeError):
        address, routed = master, None
    environ.update(control_env(environ, routed))
    error = loopback_error(environ.get("GLOO_SOCKET_IFNAME"), machines(env) if env else 1,
                           master, address)
    if error:
        raise UserError(error)
    return (f"control plane: MASTER_ADDR {master} ({address}) routed via {routed or '?'}; "
            f"GLOO_SOCKET_IFNAME={environ.get('GLOO_SOCKET_IFNAME', '(unset)')} "
            f"NCCL_SOCKET_IFNAME={environ.get('NCCL_SOCKET_IFNAME', '(unset)')} "
            f"{SITE_VAR}={environ.get(SITE_VAR, '(unset)')} pid {os.getpid()}")
