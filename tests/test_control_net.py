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

from enn_cluster.errors import UserError
from enn_cluster.worker import control_net
from enn_cluster.worker.environment import WorkerEnv

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
    ({}, None, {}),  # nothing known: NCCL chooses (it skips lo and docker*, prefers ib*)
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


def _world(launcher: str, nodes: int) -> WorkerEnv:
    return WorkerEnv(launcher, 0, 0, 2 * nodes, 2, 0, nodes, "n1", 29500)


@pytest.mark.parametrize("interface,hosts,wrong", [
    ("lo", 2, True),  # the hostname's 127.0.1.1 line in /etc/hosts: peers cannot connect
    ("eth0,lo", 4, True),
    ("lo", 1, False),  # one machine: loopback is right
    ("ib0", 2, False), (None, 2, False),  # no choice: NCCL's own skips lo
    ("lo0", 2, False),
])
def test_loopback_on_a_multi_node_job_is_named(interface, hosts, wrong):
    error = control_net.loopback_error(interface, hosts, "n1", "127.0.1.1")
    assert (error is not None) is wrong
    if wrong:
        assert "\n" not in error and f"{hosts}-node job" in error
        assert "socket_ifname (ENN_SOCKET_IFNAME)" in error and "/etc/hosts" in error
        assert "MASTER_ADDR n1 resolves to 127.0.1.1" in error


def test_local_launcher_nodes_share_one_machine():
    assert control_net.machines(_world("local", 2)) == 1
    assert control_net.machines(_world("slurm", 2)) == 2
    assert control_net.machines(_world("torchrun", 3)) == 3


def test_apply_stops_a_multi_node_job_on_loopback(tmp_path):
    route = tmp_path / "route"
    route.write_text(TABLE)
    environ = {"MASTER_ADDR": "127.0.1.1"}
    with pytest.raises(UserError, match=r"^control plane: this 2-node job .* lo "):
        control_net.apply(environ, str(route), env=_world("slurm", 2))
    for env in (_world("slurm", 1), _world("local", 2), None):  # one machine: fine on lo
        environ = {"MASTER_ADDR": "127.0.1.1"}
        control_net.apply(environ, str(route), env=env)
        assert environ["GLOO_SOCKET_IFNAME"] == "lo"
    environ = {"MASTER_ADDR": "127.0.1.1", "ENN_SOCKET_IFNAME": "ib0"}  # the site's fix
    control_net.apply(environ, str(route), env=_world("slurm", 2))
    assert environ["NCCL_SOCKET_IFNAME"] == "=ib0"
