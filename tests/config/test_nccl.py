"""NCCL fabric detection on fake sysfs trees, and the per-profile environment."""
from __future__ import annotations

import os

import pytest

from enn_cluster.config import nccl
from enn_cluster.errors import UserError
from helpers import ROOT


def make_sysfs(root, rdma=(), net=("lo", "eth0"), drivers=None, ports=None):
    """A fake /sys: class/infiniband/<dev>/device/driver -> .../drivers/<name>, class/net/*,
    class/infiniband/<dev>/ports/<n>/{link_layer,state} (`ports`: dev -> [(layer, state)];
    a device left out has one ACTIVE InfiniBand port)."""
    drivers, ports = drivers or {}, ports or {}
    for dev in rdma:
        device = root / "class" / "infiniband" / dev / "device"
        device.mkdir(parents=True)
        for n, (layer, state) in enumerate(ports.get(dev, [("InfiniBand", "4: ACTIVE")]), 1):
            port = root / "class" / "infiniband" / dev / "ports" / str(n)
            port.mkdir(parents=True)
            (port / "link_layer").write_text(f"{layer}\n")
            (port / "state").write_text(f"{state}\n")
        if dev in drivers:
            target = root / "bus" / "pci" / "drivers" / drivers[dev]
            target.mkdir(parents=True, exist_ok=True)
            os.symlink(target, device / "driver")
    for name in net:
        (root / "class" / "net" / name).mkdir(parents=True)
    return str(root)


@pytest.fixture
def no_libfabric(tmp_path):
    return (str(tmp_path / "no-such-efa"),)


@pytest.fixture
def libfabric(tmp_path):
    (tmp_path / "opt-amazon-efa").mkdir()
    return (str(tmp_path / "opt-amazon-efa"),)


def test_efa_by_device_name(tmp_path, no_libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("rdmap16s27", "rdmap32s27"))
    assert nccl.detect_fabric(root, {}, no_libfabric) == "efa"
    found = nccl.scan_interfaces(root, no_libfabric)
    assert found.efa_devices == ("rdmap16s27", "rdmap32s27") and found.ib_devices == ()


def test_efa_by_driver(tmp_path, no_libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("roce0",), drivers={"roce0": "efa"})
    assert nccl.detect_fabric(root, {}, no_libfabric) == "efa"


def test_unreadable_device_with_libfabric_is_efa(tmp_path, libfabric, no_libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("dev0",))
    assert nccl.detect_fabric(root, {}, libfabric) == "efa"
    assert nccl.detect_fabric(root, {}, no_libfabric) == "ib"


def test_infiniband_lists_mlx5_devices_in_natural_order(tmp_path, libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("mlx5_10", "mlx5_0", "mlx5_1"),
                      drivers={"mlx5_0": "mlx5_core"})
    found = nccl.scan_interfaces(root, libfabric)  # libfabric does not make mlx5 EFA
    assert found.fabric == "ib"
    env = nccl.nccl_env("auto", {}, found)
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_10:1"
    assert env["NCCL_IB_TIMEOUT"] == "22" and env["NCCL_IB_RETRY_CNT"] == "7"
    assert "FI_PROVIDER" not in env and "NCCL_IB_DISABLE" not in env


def test_nccl_ib_hca_keeps_only_active_infiniband_ports(tmp_path, no_libfabric):
    """Issue 25 item 6: a RoCE (Ethernet) port, a port that is down and a port still
    initialising are left out; a dual-port HCA keeps its one ACTIVE port."""
    root = make_sysfs(tmp_path / "sys", rdma=("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"),
                      ports={"mlx5_1": [("Ethernet", "4: ACTIVE")],  # RoCE storage NIC
                             "mlx5_2": [("InfiniBand", "1: DOWN")],
                             "mlx5_3": [("InfiniBand", "2: INIT"), ("InfiniBand", "4: ACTIVE")],
                             "mlx5_4": [("InfiniBand", "4: ACTIVE"), ("InfiniBand", "1: DOWN")]})
    found = nccl.scan_interfaces(root, no_libfabric)
    assert found.fabric == "ib" and len(found.ib_devices) == 5
    assert found.ib_hca == ("mlx5_0:1", "mlx5_3:2", "mlx5_4:1")
    assert nccl.nccl_env("auto", {}, found)["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_3:2,mlx5_4:1"


def test_no_active_infiniband_port_leaves_nccl_ib_hca_to_nccl(tmp_path, no_libfabric):
    """Only RoCE or down ports, or no readable port state: NCCL_IB_HCA unset (an
    environment variable would also override the image's nccl.conf)."""
    root = make_sysfs(tmp_path / "roce", rdma=("mlx5_0", "mlx5_1"),
                      ports={"mlx5_0": [("Ethernet", "4: ACTIVE")],
                             "mlx5_1": [("InfiniBand", "1: DOWN")]})
    found = nccl.scan_interfaces(root, no_libfabric)
    assert found.fabric == "ib" and found.ib_hca == ()
    env = nccl.nccl_env("ib", {}, found)
    assert "NCCL_IB_HCA" not in env and env["NCCL_IB_TIMEOUT"] == "22"
    bare = make_sysfs(tmp_path / "bare", rdma=("mlx5_0",), ports={"mlx5_0": []})
    assert "NCCL_IB_HCA" not in nccl.nccl_env("auto", {}, nccl.scan_interfaces(bare, no_libfabric))


def test_socket_when_no_rdma(tmp_path, libfabric):
    root = make_sysfs(tmp_path / "sys", net=("lo", "eth0", "docker0", "virbr0", "br-1a2b"))
    assert nccl.detect_fabric(root, {}, libfabric) == "socket"
    env = nccl.nccl_env("auto", {}, nccl.scan_interfaces(root, libfabric))
    assert env["NCCL_IB_DISABLE"] == "1"


@pytest.mark.parametrize("profile", ["auto", "efa", "ib", "socket"])
def test_no_profile_sets_the_socket_interface(tmp_path, libfabric, profile):
    """control_net names one interface (site or route) before the profile; with neither,
    NCCL's own choice (skips lo and docker*, prefers ib*) beats an exclusion list that
    could land bootstrap on a storage or BMC NIC."""
    root = make_sysfs(tmp_path / "sys", rdma=("mlx5_0",),
                      net=("lo", "eth0", "eno2", "ib0", "docker0", "virbr0"))
    found = nccl.scan_interfaces(root, libfabric)
    assert "NCCL_SOCKET_IFNAME" not in nccl.nccl_env(profile, {}, found)
    assert "NCCL_SOCKET_IFNAME" not in nccl.script_env(profile)
    environ = {"ENN_NCCL_PROFILE": profile}
    nccl.configure(environ, sysfs_root=root, libfabric_paths=libfabric)
    assert "NCCL_SOCKET_IFNAME" not in environ
    environ = {"NCCL_SOCKET_IFNAME": "=ib0"}  # control_net's choice is kept
    nccl.configure(environ, profile, sysfs_root=root, libfabric_paths=libfabric)
    assert environ["NCCL_SOCKET_IFNAME"] == "=ib0"


def test_missing_sysfs_is_socket(tmp_path, no_libfabric):
    assert nccl.detect_fabric(str(tmp_path / "nothing"), {}, no_libfabric) == "socket"


def test_fabric_override_from_environ(tmp_path, no_libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("mlx5_0",))
    assert nccl.detect_fabric(root, {"ENN_FABRIC": "socket"}, no_libfabric) == "socket"
    with pytest.raises(UserError, match="ENN_FABRIC"):
        nccl.detect_fabric(root, {"ENN_FABRIC": "omnipath"}, no_libfabric)


def test_efa_profile_values():
    env = nccl.nccl_env("efa", {})
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_SET_CUDA_SYNC_MEMOPS"] == "0"
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert "LD_LIBRARY_PATH" not in env  # set at exec by exec_env, inside the container
    for name, value in nccl.COMMON_ENV.items():
        assert env[name] == value


@pytest.mark.parametrize("profile", ["efa", "ib", "socket"])
def test_user_set_variables_are_never_overridden(profile):
    full = nccl.nccl_env(profile, {}, nccl.Interfaces(ib_devices=("mlx5_0",), ib_hca=("mlx5_0:1",)))
    names = list(full)
    user = {n: "user-value" for n in names}
    assert not set(nccl.nccl_env(profile, user, nccl.Interfaces(ib_devices=("mlx5_0",), ib_hca=("mlx5_0:1",)))) & set(names)
    for name in names:  # one at a time, too: only that one disappears
        env = nccl.nccl_env(profile, {name: ""}, nccl.Interfaces(ib_devices=("mlx5_0",), ib_hca=("mlx5_0:1",)))
        assert name not in env and set(env) == set(full) - {name}


def test_none_profile_sets_nothing_and_bad_profile_is_a_user_error():
    assert nccl.nccl_env("none", {}) == {}
    with pytest.raises(UserError, match="nccl_profile: 'fast'.*auto, efa, ib, socket, none"):
        nccl.nccl_env("fast", {})


def test_every_name_we_may_set_is_listed():
    emitted = set()
    for profile in ("efa", "ib", "socket"):
        emitted |= set(nccl.nccl_env(profile, {}, nccl.Interfaces(ib_devices=("mlx5_0",), ib_hca=("mlx5_0:1",))))
    assert emitted <= set(nccl.NCCL_ENV_NAMES)
    assert emitted <= set(nccl.CONTAINER_ENV_NAMES)
    assert "LD_LIBRARY_PATH" not in nccl.CONTAINER_ENV_NAMES  # would replace the image's


def test_script_env_decides_nothing_node_specific():
    assert nccl.script_env("auto") == nccl.COMMON_ENV
    assert "NCCL_IB_HCA" not in nccl.script_env("ib")
    assert nccl.script_env("efa")["FI_PROVIDER"] == "efa"
    assert nccl.script_env("none") == {}


def test_configure_applies_the_detected_profile(tmp_path, no_libfabric):
    root = make_sysfs(tmp_path / "sys", rdma=("mlx5_0",))
    environ = {"ENN_NCCL_PROFILE": "auto", "NCCL_IB_TIMEOUT": "30"}
    assert nccl.configure(environ, sysfs_root=root, libfabric_paths=no_libfabric) == "ib"
    assert environ["NCCL_IB_HCA"] == "=mlx5_0:1" and environ["NCCL_IB_TIMEOUT"] == "30"
    environ = {"ENN_NCCL_PROFILE": "none"}
    assert nccl.configure(environ, sysfs_root=root) == "none" and len(environ) == 1
    environ = {}
    assert nccl.configure(environ, "socket", sysfs_root=root) == "socket"
    assert environ["NCCL_IB_DISABLE"] == "1"


def test_efa_behind_the_mellanox_hook_is_found_through_dev_and_the_driver(tmp_path, no_libfabric):
    """Enroot's Mellanox hook hides non-mlx devices from /sys/class/infiniband (p5 looked
    like 'socket'); the EFA driver and /dev/infiniband/uverbs* still show EFA."""
    root = make_sysfs(tmp_path / "sys", rdma=())
    dev = tmp_path / "dev"
    (dev / "infiniband").mkdir(parents=True)
    for name in ("uverbs1", "uverbs0", "rdma_cm"):
        (dev / "infiniband" / name).write_text("")
    assert nccl.scan_interfaces(root, no_libfabric, str(dev)).fabric == "socket"  # no driver
    (tmp_path / "sys" / "module" / "efa").mkdir(parents=True)
    found = nccl.scan_interfaces(root, no_libfabric, str(dev))
    assert found.fabric == "efa" and found.efa_devices == ("uverbs0", "uverbs1")
    # an IB host with mlx5 listed stays IB even with /dev/infiniband present
    ib_root = make_sysfs(tmp_path / "sys-ib", rdma=("mlx5_0",))
    (tmp_path / "sys-ib" / "module" / "efa").mkdir(parents=True)
    assert nccl.scan_interfaces(ib_root, no_libfabric, str(dev)).fabric == "ib"


def test_flight_recorder_dumps_go_to_the_run_logs():
    env = nccl.flight_recorder_env("/runs/r/logs/slurm-7-r0", {})
    assert env == {"TORCH_FR_DUMP_TEMP_FILE": "/runs/r/logs/slurm-7-r0/nccl-trace-rank-",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/r/logs/slurm-7-r0/nccl-trace-rank-"}
    assert nccl.flight_recorder_env("/x", {"TORCH_FR_DUMP_TEMP_FILE": "/y"}) == {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/nccl-trace-rank-"}


def test_report_names_effective_values_and_warns_where_the_image_differs():
    environ = {**nccl.nccl_env("ib", {}), "NCCL_IB_TIMEOUT": "18", "NCCL_IB_RETRY_CNT": "14",
               "NCCL_SOCKET_IFNAME": "=ib0", "GLOO_SOCKET_IFNAME": "ib0", "PATH": "/bin"}
    lines = nccl.report(environ, "ib")
    level, first = lines[0]
    assert level == "info" and first.startswith("NCCL environment (ib): ")
    assert "GLOO_SOCKET_IFNAME=ib0" in first and "NCCL_IB_TIMEOUT=18" in first
    assert "PATH" not in first
    warnings = [line for level, line in lines if level == "warning"]
    assert warnings == [
        "NCCL_IB_TIMEOUT=18 differs from the ib profile's 22: a value already set (the image's "
        "ENV, or the job's) wins; unset it in the image or pass it with --container-env",
        "NCCL_IB_RETRY_CNT=14 differs from the ib profile's 7: a value already set (the "
        "image's ENV, or the job's) wins; unset it in the image or pass it with --container-env",
        "out of its documented range: NCCL_IB_RETRY_CNT=14 (expected 0..7)"]
    assert [lv for lv, _ in nccl.report(nccl.nccl_env("efa", {}), "efa")] == ["info"]


def test_nccl_heartbeat_outlasts_the_collective_timeout():
    from enn_cluster.config.nccl import heartbeat_env

    assert heartbeat_env(300) == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}  # torch's default
    assert heartbeat_env(1800) == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1920"}


def test_a_locked_memory_limit_too_small_for_rdma_is_refused_with_the_fix(tmp_path):
    """Issue 39: a login node's `ulimit -l` carried into the task makes NCCL's IB/EFA
    registration fail at the first collective. The task reads its own limit (here one set
    by prlimit on a real process) and a fabric profile refuses it in one line."""
    import shutil
    import subprocess
    import sys

    from enn_cluster.config.nccl import memlock_problem

    line = memlock_problem("ib", 64 << 10)
    assert line.startswith("ulimit -l: this task may lock 64 KiB of memory, and NCCL over ib")
    assert "PropagateResourceLimitsExcept=MEMLOCK" in line and "\n" not in line
    assert memlock_problem("efa", 8 << 20).startswith("ulimit -l: this task may lock 8192 KiB")
    assert memlock_problem("ib", None) is None  # unlimited
    assert memlock_problem("socket", 64 << 10) is None  # no RDMA, nothing pinned
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit")
    code = "from enn_cluster.worker.entry import memlock_limit; print(memlock_limit())"
    done = subprocess.run(["prlimit", "--memlock=65536:65536", sys.executable, "-c", code],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "65536", done.stderr


def _pci(root, parts, vendor, cls):
    """A PCI function at devices/pci0000:00/PARTS..., listed in bus/pci/devices."""
    dev = root / "devices" / "pci0000:00"
    for part in parts:
        dev = dev / part
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    (dev / "class").write_text(cls + "\n")
    (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    os.symlink(dev, root / "bus" / "pci" / "devices" / parts[-1])
    return dev


def _hca(root, name, pci_dev):
    base = root / "class" / "infiniband" / name
    (base / "ports" / "1").mkdir(parents=True)
    (base / "ports" / "1" / "link_layer").write_text("InfiniBand\n")
    (base / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    os.symlink(pci_dev, base / "device")


def test_nccl_ib_hca_names_the_ports_that_share_a_root_port_with_a_gpu(tmp_path, no_libfabric):
    """A DGX-style node: each GPU and its rail's HCA behind one PCIe switch on a root port,
    a storage HCA on a root port of its own (ACTIVE InfiniBand too): NCCL_IB_HCA names the
    rails only. With no GPU in sysfs, or none near an HCA, every ACTIVE port stays."""
    nvidia, gpu, mellanox, nic = "0x10de", "0x030200", "0x15b3", "0x020700"
    for i, port in enumerate(("0000:00:01.0", "0000:00:02.0")):
        _pci(tmp_path, (port, f"0000:0{i}:00.0", f"0000:1{i}:00.0"), nvidia, gpu)
        _hca(tmp_path, f"mlx5_{i}", _pci(tmp_path, (port, f"0000:0{i}:00.0", f"0000:2{i}:00.0"),
                                        mellanox, nic))
    _hca(tmp_path, "mlx5_2", _pci(tmp_path, ("0000:00:03.0", "0000:30:00.0"), mellanox, nic))
    found = nccl.scan_interfaces(str(tmp_path), no_libfabric)
    assert found.ib_devices == ("mlx5_0", "mlx5_1", "mlx5_2")
    assert found.ib_hca == ("mlx5_0:1", "mlx5_1:1")  # not the storage HCA
    assert nccl.nccl_env("auto", {}, found)["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    assert nccl.near_gpu_ports(tmp_path, ["mlx5_2:1"]) == ("mlx5_2:1",)  # none near: all
    bare = tmp_path / "no-gpus"
    _hca(bare, "mlx5_0", _pci(bare, ("0000:00:01.0", "0000:01:00.0"), mellanox, nic))
    assert nccl.scan_interfaces(str(bare), no_libfabric).ib_hca == ("mlx5_0:1",)

