"""The control-plane interface: one choice for gloo and NCCL bootstrap, from the site or the
kernel's route to MASTER_ADDR. Route tables are in the /proc/net/route format
(net/ipv4/fib_trie.c fib_route_seq_show: addresses as host-order %08X, flags from
include/uapi/linux/route.h, RTF_UP = 0x1); the answer is cross-checked against
`ip route get` (iproute2) on this machine's own table."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from enn_cluster.worker import control_net
from enn_cluster.worker.environment import WorkerEnv
from helpers import ROOT, cli, metrics, small_config, write_config

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
def test_loopback_across_machines_is_named(interface, hosts, wrong):
    error = control_net.loopback_error(interface, hosts, "n1", "127.0.1.1")
    assert (error is not None) is wrong
    if wrong:
        assert "\n" not in error and f"spans {hosts} machines" in error
        assert "socket_ifname (ENN_SOCKET_IFNAME)" in error and "/etc/hosts" in error
        assert "MASTER_ADDR n1 resolves to 127.0.1.1" in error


def test_local_launcher_nodes_share_one_machine():
    assert control_net.machines(_world("local", 2)) == 1
    assert control_net.machines(_world("slurm", 2)) == 2
    assert control_net.machines(_world("torchrun", 3)) == 3


def _post(host: str, environ: dict) -> str:
    """peer_post as a rank on `host` writes it (the host identity replaced)."""
    _, on_lo, master, address = json.loads(control_net.peer_post(environ))
    return json.dumps([host, on_lo, master, address])


LO = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def test_loopback_is_refused_only_when_the_ranks_span_machines():
    """Two torchrun agents on one machine (one host identity): lo is right. The same world
    over two machines: refused in one line. Peers on other hosts that route elsewhere do
    not excuse the rank that would listen on lo."""
    here = [_post("h1", LO), _post("h1", LO)]
    assert control_net.loopback_refusal(here) == ""
    apart = [_post("h1", LO), _post("h2", dict(LO, GLOO_SOCKET_IFNAME="ib0"))]
    line = control_net.loopback_refusal(apart)
    assert line.startswith("control plane: this job spans 2 machines but would talk over the "
                           "loopback interface lo (MASTER_ADDR 127.0.0.1 resolves to 127.0.0.1")
    assert control_net.loopback_refusal([_post("h1", dict(LO, GLOO_SOCKET_IFNAME="eth0")),
                                         _post("h2", {"GLOO_SOCKET_IFNAME": "eth0"})]) == ""


def test_a_site_that_names_lo_is_honoured():
    """ENN_SOCKET_IFNAME=lo is the site's (or the user's) word: never refused, even apart."""
    environ = {"MASTER_ADDR": "127.0.1.1", control_net.SITE_VAR: "lo"}
    control_net.apply(environ, "/nonexistent/route")
    assert environ["GLOO_SOCKET_IFNAME"] == "lo" and environ["NCCL_SOCKET_IFNAME"] == "=lo"
    assert control_net.loopback_refusal([_post("h1", environ), _post("h2", environ)]) == ""


def test_apply_leaves_the_judgement_to_the_peers(tmp_path):
    route = tmp_path / "route"
    route.write_text(TABLE)
    environ = {"MASTER_ADDR": "127.0.1.1"}
    control_net.apply(environ, str(route))  # no refusal here: the ranks' hosts decide
    assert environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert json.loads(control_net.peer_post(environ))[1:] == [True, "127.0.1.1", "127.0.1.1"]
    environ = {"MASTER_ADDR": "127.0.1.1", "ENN_SOCKET_IFNAME": "ib0"}  # the site's fix
    control_net.apply(environ, str(route))
    assert environ["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert json.loads(control_net.peer_post(environ))[1] is False


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="a network namespace of its own needs unshare as root")
def test_another_network_namespace_is_another_machine():
    """What loopback reaches: a process in a network namespace of its own (as each node of
    the dev Slurm cluster) has another host identity than this one, on the same host."""
    code = "from enn_cluster.worker.control_net import host_identity; print(host_identity())"
    args = [sys.executable, "-c", code]
    same = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT)
    other = subprocess.run(["unshare", "--net", *args], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert same.returncode == other.returncode == 0, other.stderr
    assert same.stdout.strip() == control_net.host_identity()
    assert other.stdout.strip() != same.stdout.strip()
    assert other.stdout.split("/")[:2] == same.stdout.split("/")[:2]  # same host, same boot


@pytest.mark.slow
def test_two_torchrun_agents_on_one_machine_train_over_loopback(tmp_path):
    """A user trying elasticity without a cluster: two torchrun agents on this machine
    (--nnodes 2, one rank each, c10d rendezvous on 127.0.0.1), gloo on lo. Before, the
    '2-node job on lo' check refused this; the ranks now see one machine and train."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "pair", training={"epochs": 1}, parallel={"nodes": 2, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = tmp_path / "runs" / "pair"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pair",
         "--rdzv-conf", f"is_host={int(host)}", "-m", "enn_cluster.worker", str(run),
         "--task", "train"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=tmp_path) for host in (True, False)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert metrics(run, "start")[0]["world_size"] == 2
    assert metrics(run, "train")[-1]["step"] == 448 // 16
    log = (next((run / "logs").rglob("rank-1.log"))).read_text()
    assert "GLOO_SOCKET_IFNAME=lo" in log, log[-2000:]
