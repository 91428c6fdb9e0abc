"""The control-plane interface: one choice for gloo and NCCL bootstrap, from the site or the
kernel's route to MASTER_ADDR. Route tables are in the /proc/net/route format
(net/ipv4/fib_trie.c fib_route_seq_show: addresses as host-order %08X, flags from
include/uapi/linux/route.h, RTF_UP = 0x1); the answer is cross-checked against
`ip route get` (iproute2) on this machine's own table."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from enn_cluster.worker import control_net

HEAD = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
# a GPU node: default and 10.0.2.0/24 on eth0 (front end), 10.16.0.0/16 on ib0 (IPoIB),
# 192.168.0.0/16 on the BMC/storage NIC eno2, a down route on eth9
TABLE = HEAD + "".join("\t".join(f) + "\n" for f in [
    ("eth0", "00000000", "0102000A", "0003", "0", "0", "100", "00000000", "0", "0", "0"),
    ("eth0", "0002000A", "00000000", "0001", "0", "0", "100", "00FFFFFF", "0", "0", "0"),
    ("ib0", "0000100A", "00000000", "0001", "0", "0", "0", "0000FFFF", "0", "0", "0"),
    ("eno2", "0000A8C0", "00000000", "0001", "0", "0", "0", "0000FFFF", "0", "0", "0"),
    ("eth9", "0000A8C0", "00000000", "0000", "0", "0", "0", "00FFFFFF", "0", "0", "0"),
    ("eth1", "0002000A", "00000000", "0001", "0", "0", "200", "00FFFFFF", "0", "0", "0"),
])


@pytest.mark.parametrize("destination,expected", [
    ("10.16.3.7", "ib0"),  # the master's IPoIB address: bootstrap over IB, not eth0
    ("10.0.2.15", "eth0"),  # same /24 on eth0 (metric 100) and eth1 (200): lower metric
    ("192.168.4.1", "eno2"),  # the down /24 on eth9 is ignored: the /16 wins
    ("8.8.8.8", "eth0"),  # only the default route matches
    ("127.0.0.1", "lo"), ("127.0.1.1", "lo"),  # loopback is not in the main table
    ("fe80::1", None), ("not-an-ip", None),
])
def test_route_interface(destination, expected):
    assert control_net.route_interface(TABLE, destination) == expected


def test_no_default_route_means_no_choice():
    table = HEAD + "ib0\t0000100A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
    assert control_net.route_interface(table, "10.0.2.15") is None


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 not installed")
def test_agrees_with_ip_route_get_on_this_machine():
    table = Path("/proc/net/route").read_text()
    for dest in ("8.8.8.8", "10.1.2.3", "192.168.1.1", "172.16.0.1"):
        done = subprocess.run(["ip", "-4", "route", "get", dest], capture_output=True, text=True)
        m = re.search(r"\bdev (\S+)", done.stdout)
        expected = m.group(1) if done.returncode == 0 and m else None
        if expected and " via " not in done.stdout and "local" in done.stdout:
            continue  # a local-table route: /proc/net/route shows only the main table
        assert control_net.route_interface(table, dest) == expected, done.stdout


@pytest.mark.parametrize("environ,routed,expected", [
    ({}, "ib0", {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib0"}),
    ({"ENN_SOCKET_IFNAME": "bond0"}, "ib0",
     {"GLOO_SOCKET_IFNAME": "bond0", "NCCL_SOCKET_IFNAME": "=bond0"}),  # the site wins
    ({"GLOO_SOCKET_IFNAME": "eth3"}, "ib0", {"NCCL_SOCKET_IFNAME": "=eth3"}),  # agree with it
    ({"NCCL_SOCKET_IFNAME": "=enp1"}, None, {"GLOO_SOCKET_IFNAME": "enp1"}),
    ({"NCCL_SOCKET_IFNAME": "^docker"}, "eth0", {"GLOO_SOCKET_IFNAME": "eth0"}),  # user's kept
    ({}, None, {}),  # nothing known: NCCL's profile exclusion list stays the fallback
])
def test_control_env(environ, routed, expected):
    assert control_net.control_env(environ, routed) == expected


def test_apply_reads_the_route_file(tmp_path):
    route = tmp_path / "route"
    route.write_text(TABLE)
    environ = {"MASTER_ADDR": "10.16.0.9"}
    line = control_net.apply(environ, str(route))
    assert environ["GLOO_SOCKET_IFNAME"] == "ib0" and environ["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert line.startswith("control plane: MASTER_ADDR 10.16.0.9 (10.16.0.9) routed via ib0;")
