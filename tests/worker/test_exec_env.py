"""The worker's environment at exec: the EFA plugin's directory must be in LD_LIBRARY_PATH
when the process starts (the loader reads it once), so the worker re-executes itself.

Proven on the real thing: a rendered batch script runs under bash with a stub `srun` that
becomes the task (exec), and the test reads /proc/PID/environ of that worker process."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enn_cluster.worker import exec_env
from enn_cluster.cluster import job_script
from enn_cluster.errors import UserError
from enn_cluster.worker.exec_env import Plugin
from enn_cluster.cluster.job_spec import JobSpec
from helpers import small_config, write_config

# Where images really keep aws-ofi-nccl (exec_env.EFA_PLUGIN_DIRS cites the sources):
LAYOUTS = [
    (f"/opt/amazon/ofi-nccl/lib/{__import__('platform').machine()}-linux-gnu",
     "libnccl-net.so"),  # recent EFA installers, multiarch
    ("/opt/amazon/ofi-nccl/lib", "libnccl-net-ofi.so"),  # EFA installer >= 1.30
    ("/opt/amazon/aws-ofi-nccl/lib", "libnccl-net.so"),  # NGC-derived images, AWS DLCs
    ("/opt/aws-ofi-nccl/lib", "libnccl-net.so"),  # aws-samples source build prefix
]


@pytest.mark.parametrize("directory,library", LAYOUTS)
def test_plugin_found_where_each_image_keeps_it(tmp_path, directory, library):
    root = tmp_path / "img"
    (root / directory.lstrip("/")).mkdir(parents=True)
    (root / directory.lstrip("/") / library).write_bytes(b"\x7fELF")
    dirs = [str(root) + d for d in exec_env.EFA_PLUGIN_DIRS]
    assert exec_env.find_plugin(dirs) == Plugin(str(root) + directory, library)
    assert exec_env.find_plugin([str(root) + "/elsewhere"]) is None


def test_plugin_search_dirs_from_the_environment():
    assert exec_env.plugin_search_dirs({}) == exec_env.EFA_PLUGIN_DIRS
    assert exec_env.plugin_search_dirs({exec_env.PLUGIN_DIRS_VAR: "/a::/b"}) == ("/a", "/b")


PLUGIN = Plugin("/opt/amazon/ofi-nccl/lib", "libnccl-net-ofi.so")
LINK = Plugin("/opt/amazon/aws-ofi-nccl/lib", "libnccl-net.so")


@pytest.mark.parametrize("environ,fabric,pinned,plugin,libfabric,expected", [
    ({}, "ib", False, PLUGIN, (), {}),
    ({}, "socket", True, None, (), {}),
    ({"ENN_ALLOW_SOCKET_FALLBACK": "1"}, "efa", False, None, (), {}),  # TCP, by the site
    # NCCL_NET_PLUGIN names the suffix (older NCCL opens only libnccl-net-<value>.so); the
    # site pins EFA, so NCCL_NET makes a plugin that fails to load an error, not TCP
    ({}, "efa", True, PLUGIN, ("/opt/amazon/efa/lib",),
     {"LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib",
      "NCCL_NET_PLUGIN": "ofi", "NCCL_NET": "AWS Libfabric"}),
    ({"LD_LIBRARY_PATH": "/usr/local/cuda/lib64:/opt/amazon/efa/lib"}, "efa", False, PLUGIN,
     ("/opt/amazon/efa/lib",),  # auto on an EFA node: the same, NCCL_NET too (issue 25)
     {"LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:/usr/local/cuda/lib64:/opt/amazon/efa/lib",
      "NCCL_NET_PLUGIN": "ofi", "NCCL_NET": "AWS Libfabric"}),
    ({}, "efa", True, LINK, (),  # libnccl-net.so is what NCCL opens when nothing is named
     {"LD_LIBRARY_PATH": "/opt/amazon/aws-ofi-nccl/lib", "NCCL_NET": "AWS Libfabric"}),
    ({"LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib", "NCCL_NET_PLUGIN": "ofi",
      "NCCL_NET": "OFI"}, "efa", True, PLUGIN, (), {}),  # the user's choices win: no re-exec
    # an image's plugin that is not in the plugin's directory is replaced (or unset, for
    # libnccl-net.so); a file name that is there is kept
    ({"NCCL_NET_PLUGIN": "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so"}, "efa", False,
     PLUGIN, (), {"LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib", "NCCL_NET_PLUGIN": "ofi",
                  "NCCL_NET": "AWS Libfabric"}),
    ({"NCCL_NET_PLUGIN": "sharp", "NCCL_NET": "OFI"}, "efa", False, LINK, (),
     {"LD_LIBRARY_PATH": "/opt/amazon/aws-ofi-nccl/lib", "NCCL_NET_PLUGIN": None}),
    ({"NCCL_NET_PLUGIN": "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "NCCL_NET": "OFI",
      "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib"}, "efa", False, PLUGIN, (), {}),
])
def test_exec_env_table(environ, fabric, pinned, plugin, libfabric, expected):
    there = {"/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "/opt/amazon/aws-ofi-nccl/lib/libnccl-net.so"}
    assert exec_env.exec_env(environ, fabric, pinned, plugin, libfabric,
                             exists=there.__contains__) == expected


def test_pinned_efa_without_plugin_is_an_error_naming_the_fix():
    with pytest.raises(UserError, match=r"ENN_NCCL_PROFILE=efa on an EFA node: no NCCL net plugin.*"
                                        r"install aws-ofi-nccl.*ENN_NCCL_PLUGIN_DIRS"):
        exec_env.exec_env({}, "efa", True, None)


def test_auto_efa_without_plugin_is_refused_unless_the_site_allows_tcp():
    """Issue 25: `auto` on a node showing EFA with no plugin would run over TCP sockets
    (an 8B all-reduce then takes seconds): refused in one line naming the fix."""
    with pytest.raises(UserError, match=r"^ENN_NCCL_PROFILE=auto on an EFA node: no NCCL net "
                                        r"plugin .*EFA_INSTALLER_VERSION.*ENN_NCCL_PLUGIN_DIRS"):
        exec_env.exec_env({}, "efa", False, None)
    assert exec_env.exec_env({}, "ib", False, None) == {}  # not EFA: nothing to say


def test_auto_efa_without_plugin_says_where_it_looked(caplog, tmp_path):
    """Where the site allows the fallback (ENN_ALLOW_SOCKET_FALLBACK=1) it runs over TCP:
    one warning line names the directories searched and the variable that adds one."""
    empty = str(tmp_path / "lib")
    allow = {"ENN_ALLOW_SOCKET_FALLBACK": "1"}
    with caplog.at_level("WARNING", logger="enn_cluster.worker.exec_env"):
        assert exec_env.exec_env({exec_env.PLUGIN_DIRS_VAR: empty, **allow}, "efa", False,
                                 None) == {}
        assert exec_env.exec_env(allow, "efa", False, None) == {}
        assert exec_env.exec_env(allow, "ib", False, None) == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith("EFA detected (ENN_NCCL_PROFILE=auto) but no NCCL net plugin")
    assert f"in {empty}:" in lines[0] and "TCP sockets" in lines[0]
    assert ", ".join(exec_env.EFA_PLUGIN_DIRS) in lines[1]
    assert all(exec_env.PLUGIN_DIRS_VAR in line for line in lines)


def test_profile_decides_what_is_pinned(tmp_path):
    assert exec_env.wanted_fabric({"ENN_NCCL_PROFILE": "efa"}) == ("efa", True)
    assert exec_env.wanted_fabric({"ENN_NCCL_PROFILE": "ib"}) == ("ib", False)
    assert exec_env.wanted_fabric({"ENN_FABRIC": "efa"}, str(tmp_path)) == ("efa", False)
    assert exec_env.wanted_fabric({}, str(tmp_path)) == ("socket", False)


# -- a worker started by the rendered script --------------------------------------------

SRUN_EXEC = """#!/bin/bash
# stub srun: drop srun's own flags, record the task's pid, become the task
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
echo $$ > "$STUB_PID"
exec "$@"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _start_script(tmp_path: Path, plugin_dir: Path) -> tuple[subprocess.Popen, Path, Path]:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    write_config(run_dir / "config.yaml", **small_config(tmp_path, "r1"))
    spec = JobSpec(job_name="enn-efa", run_dir=str(run_dir), gpus_per_node=0, procs_per_node=2,
                   nccl_profile="efa", python=sys.executable)
    script = tmp_path / "job.sbatch"
    script.write_text(job_script.render_batch_script(spec))
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "srun").write_text(SRUN_EXEC)
    (stub_bin / "srun").chmod(0o755)
    env = {"PATH": f"{stub_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "STUB_PID": str(tmp_path / "pid"),
           "LD_LIBRARY_PATH": "/usr/lib/x", exec_env.PLUGIN_DIRS_VAR: str(plugin_dir)}
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, run_dir, tmp_path / "pid"


def test_worker_holds_the_plugin_path_at_exec(tmp_path):
    plugin_dir = tmp_path / "img" / "opt" / "amazon" / "ofi-nccl" / "lib"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "libnccl-net-ofi.so").write_bytes(b"\x7fELF")
    proc, run_dir, pid_file = _start_script(tmp_path, plugin_dir)
    rank_log = run_dir / "logs" / "slurm-4242-r0" / "rank-0.log"
    try:
        # rank 0 of 2 waits in the rendezvous for rank 1, which never comes: it stays alive
        for _ in range(1200):
            if rank_log.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert rank_log.exists(), proc.communicate()[1] if proc.poll() is not None else "no log"
        environ = _environ_of(int(pid_file.read_text()))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
        proc.communicate()
    assert environ["LD_LIBRARY_PATH"] == f"{plugin_dir}:/usr/lib/x"
    assert environ["NCCL_NET_PLUGIN"] == "ofi" and environ["NCCL_NET"] == "AWS Libfabric"
    assert environ[exec_env.READY_VAR] == "1" and environ["FI_PROVIDER"] == "efa"


def test_worker_refuses_efa_without_the_plugin(tmp_path):
    empty = tmp_path / "img" / "lib"
    empty.mkdir(parents=True)
    proc, run_dir, _ = _start_script(tmp_path, empty)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.startswith("enn_cluster worker:")]
    assert len(lines) == 1 and "no NCCL net plugin" in lines[0] and str(empty) in lines[0]
    assert not (run_dir / "logs" / "slurm-4242-r0").exists()  # nothing started


@pytest.mark.parametrize("argv,ok", [
    (["python3", "-m", "enn_cluster.worker", "/r", "--task", "train"], True),
    (["python3", "-u", "-m", "submitit.core._submit", "/r/slurm/7"], True),
    (["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
      "pipe_handle=7)", "--multiprocessing-fork"], False),
])
def test_spawned_children_are_not_reexecuted(argv, ok):
    assert exec_env.can_reexec(argv) is ok


def _efa_step() -> str:
    """containers/Dockerfile's EFA RUN step, as the shell runs it."""
    text = (Path(__file__).resolve().parents[2] / "containers" / "Dockerfile").read_text()
    step = text.split('ARG EFA_INSTALLER_VERSION=""\nRUN ', 1)[1]
    return step[:step.index("\n    fi\n") + len("\n    fi\n")]


def test_the_image_build_installs_efa_only_when_asked_and_checks_the_plugin(tmp_path):
    """Issue 25 item 1: `--build-arg EFA_INSTALLER_VERSION=...` runs AWS's installer with
    --skip-kmod (the host's module) and stops the build when no aws-ofi-nccl lands where
    the worker looks; without it the step does nothing."""
    step = _efa_step()
    assert "./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify" in step
    assert "/opt/amazon/ofi-nccl/lib" in exec_env.EFA_PLUGIN_DIRS
    assert "/opt/amazon/ofi-nccl/lib/*/libnccl-net*.so" in step
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 22\n")  # no network in a test
    (bin_dir / "curl").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    off = subprocess.run(["sh", "-c", step], env={**env, "EFA_INSTALLER_VERSION": ""},
                         capture_output=True, text=True, cwd=tmp_path)
    assert off.returncode == 0 and off.stderr == ""
    on = subprocess.run(["sh", "-c", step], env={**env, "EFA_INSTALLER_VERSION": "1.43.2"},
                        capture_output=True, text=True, cwd=tmp_path)
    assert on.returncode == 1
    assert on.stderr.strip() == ("efa: installer 1.43.2 failed or left no aws-ofi-nccl in "
                                 "/opt/amazon/ofi-nccl")
