"""The local launcher's workers, seen from /proc while they hold at a checkpoint: forked from
a launcher of our own (the CLI), fresh interpreters from a caller's process (the API).

A forked worker must start as `python -m enn_cluster.worker` would: its own session, no
handler of the elastic agent's (HUP, QUIT) left in it, the stop handlers its own. Each run
then finishes, so the fork changes nothing of what a run does (the e2e suites compare the
runs themselves)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, cli_env, fresh_cli, small_config, write_config

HOLD = "ENN_FAULT_HOLD_BEFORE_COMMIT"


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state is [0], ppid [1], session [3])."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def _caught(pid: int) -> set[int]:
    """The signals PID has a handler for (SigCgt of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"/proc/{pid}/status has no SigCgt")


def _worker_pids(run: Path) -> list[int]:
    """Each rank's pid, from the first line of its log ("... pid N host ...")."""
    pids = []
    for log in sorted(run.glob("logs/*/rank-*.log")):
        words = log.read_text().split()
        pids.append(int(words[words.index("pid") + 1]))
    return pids


def _held(launcher: subprocess.Popen, run: Path, held: Path, ranks: int) -> list[int]:
    """The workers' pids once every rank holds at the checkpoint (the launcher still runs)."""
    deadline = time.monotonic() + 120
    while not all((held / f"held-rank-{rank}").exists() for rank in range(ranks)):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no rank held at the checkpoint in 120 s"
        time.sleep(0.2)
    return _worker_pids(run)


def _launch(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    held = tmp_path / "held"
    held.mkdir()
    env = {**os.environ, HOLD: f"8:{held}",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH"))))}
    return subprocess.Popen([sys.executable, *argv], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), held


def _finish(launcher: subprocess.Popen, held: Path) -> None:
    (held / "release").touch()
    out, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, err[-3000:]


def _started(run: Path) -> set[str]:
    """How each rank began, as its backend report says (what doctor and status read)."""
    return {json.loads(p.read_text())["worker_start"]
            for p in run.glob("logs/*/backend-rank-*.json")}


def test_the_cli_forks_workers_that_start_as_fresh_ones_would(tmp_path):
    """Two workers forked from the CLI: the launcher's children with its command line (a
    copy of it, which had imported torch once for both), each in a session of its own, with
    handlers for the stop signals alone (TERM, INT, USR2: a checkpoint, then exit)."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "forked", parallel={"nodes": 1, "procs_per_node": 2}))
    launcher, held = _launch(tmp_path, ["-m", "enn_cluster.client.cli", "train",
                                        "--config", str(cfg)])
    try:
        workers = _held(launcher, tmp_path / "runs" / "forked", held, 2)
        cmdline = Path(f"/proc/{launcher.pid}/cmdline").read_bytes()
        assert len(workers) == 2
        for pid in workers:
            state = _stat(pid)
            assert int(state[1]) == launcher.pid and int(state[3]) == pid, state
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline
            caught = _caught(pid)
            assert {signal.SIGTERM, signal.SIGINT, signal.SIGUSR2} <= caught, caught
            assert not {signal.SIGHUP, signal.SIGQUIT} & caught, caught  # the agent's, undone
        assert {signal.SIGHUP, signal.SIGQUIT} <= _caught(launcher.pid)  # the agent has them
    finally:
        _finish(launcher, held)
    assert _started(tmp_path / "runs" / "forked") == {"forked"}


FAKE_DRIVER = """
static int ready;
int cuInit(unsigned int flags) { ready = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!ready) return 3; *count = 1; return 0; }
"""


@pytest.mark.parametrize("initialised", [True, False])
def test_a_launcher_that_initialised_the_cuda_driver_starts_fresh_workers(tmp_path,
                                                                          initialised):
    """Once anything in the launcher has initialised the CUDA driver (a device count at
    import is enough), a forked copy would fail at its first CUDA call: the CLI then starts
    fresh interpreters. A driver only loaded (a library linking it) is no reason: the
    copies are forked. The driver is a stand-in built here with its two entry points, as
    the real one answers them (CUDA_ERROR_NOT_INITIALIZED before cuInit), loaded into the
    launcher under its name."""
    driver = tmp_path / "driver" / "libcuda.so.1"
    driver.parent.mkdir()
    (tmp_path / "driver.c").write_text(FAKE_DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(driver), str(tmp_path / "driver.c")],
                   check=True)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "driver", parallel={"nodes": 1, "procs_per_node": 2}))
    wrapper = ("import ctypes, runpy, sys\n"
               f"driver = ctypes.CDLL({str(driver)!r})\n"
               + ("driver.cuInit(0)\n" if initialised else "") +
               "sys.argv = ['enn-submit', 'train', '--config', sys.argv[1]]\n"
               "runpy.run_module('enn_cluster.client.cli', run_name='__main__')\n")
    launcher, held = _launch(tmp_path, ["-c", wrapper, str(cfg)])
    try:
        for pid in _held(launcher, tmp_path / "runs" / "driver", held, 2):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            fresh = argv[1:4] == [b"-u", b"-m", b"enn_cluster.worker"]
            assert fresh == initialised, argv
    finally:
        _finish(launcher, held)
    assert _started(tmp_path / "runs" / "driver") == {"fresh" if initialised else "forked"}


# getaddrinfo, noting each name a forked copy asks to resolve (a number is no lookup)
RESOLVER_WATCH = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int forked;
static void child(void) { forked = 1; }
__attribute__((constructor)) static void init(void) { pthread_atfork(0, 0, child); }
int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    static int (*real)(const char *, const char *, const struct addrinfo *,
                       struct addrinfo **);
    unsigned char addr[16];
    const char *out = getenv("RESOLVER_WATCH_LOG");
    if (!real) real = dlsym(RTLD_NEXT, "getaddrinfo");
    if (forked && node && out && inet_pton(AF_INET, node, addr) != 1
            && inet_pton(AF_INET6, node, addr) != 1) {
        FILE *f = fopen(out, "a");
        if (f) { fprintf(f, "%d %s\n", (int)getpid(), node); fclose(f); }
    }
    return real(node, service, hints, res);
}
"""


def test_forked_workers_never_ask_the_resolver(tmp_path):
    """A forked worker inherits the launcher's locks as they were at the fork: one forked
    while an agent thread was inside getaddrinfo waited for good on glibc's resolver lock
    at its first lookup of a name (CI: one predict in some 240). The workers are told a
    numeric MASTER_ADDR and look up no name at all; getaddrinfo is watched in every forked
    copy of the launcher, from the fork to its end."""
    watch = tmp_path / "watch.so"
    (tmp_path / "watch.c").write_text(RESOLVER_WATCH)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(watch), str(tmp_path / "watch.c"),
                    "-ldl", "-lpthread"], check=True)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "named", training={"max_steps": 2},
        parallel={"nodes": 2, "procs_per_node": 2}))
    log = tmp_path / "lookups.txt"
    done = fresh_cli(["train", "--config", str(cfg)],
                     cli_env({"LD_PRELOAD": str(watch), "RESOLVER_WATCH_LOG": str(log)}), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _started(tmp_path / "runs" / "named") == {"forked"}
    assert not log.exists(), log.read_text()


def test_a_callers_process_is_never_forked(tmp_path):
    """`enn_cluster.train` in a user's script launches in that process, which may hold CUDA
    or threads a copy would inherit broken: its workers are fresh interpreters."""
    script = tmp_path / "user.py"
    script.write_text(
        "import sys\nimport torch\nimport enn_cluster\n"
        "x = torch.randn(256, 8)\ny = x.sum(1, keepdim=True)\n"
        "enn_cluster.train(torch.nn.Linear(8, 1), x, y, run_dir=sys.argv[1],\n"
        "                  training={'epochs': 2, 'per_device_train_batch_size': 8},\n"
        "                  checkpoint={'every_steps': 8},\n"
        "                  parallel={'nodes': 1, 'procs_per_node': 2})\n")
    run = tmp_path / "runs" / "api"
    launcher, held = _launch(tmp_path, [str(script), str(run)])
    try:
        workers = _held(launcher, run, held, 2)
        assert len(workers) == 2
        for pid in workers:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[1:4] == [b"-u", b"-m", b"enn_cluster.worker"], argv
            assert int(_stat(pid)[1]) == launcher.pid
    finally:
        _finish(launcher, held)
    assert _started(run) == {"fresh"}


def test_the_driver_is_read_from_the_memory_map():
    """libcuda (the driver) is asked; the CUDA runtime and NVML, which torch and
    transformers load without touching a device, are not. A driver that cannot be asked
    (here: not there to load) counts as initialised: no fork."""
    from enn_cluster.client.launch_local import cuda_started

    row = "7f0a1c000000-7f0a1c200000 r-xp 00000000 fd:01 1234 {}"
    assert cuda_started(row.format("/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"))
    assert cuda_started(row.format("/usr/local/nvidia/lib64/libcuda.so.1"))
    quiet = "\n".join(row.format(p) for p in (
        "/opt/venv/nvidia/cuda_runtime/lib/libcudart.so.13", "/usr/lib/libnvidia-ml.so.1",
        "/opt/venv/torch/lib/libtorch_cuda.so"))
    assert not cuda_started(quiet + "\n7ffd1000-7ffd2000 rw-p 00000000 00:00 0 \n")
