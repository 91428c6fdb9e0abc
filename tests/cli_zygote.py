"""`enn-submit` in a process forked from an interpreter that has already imported what the
CLI imports, so that a test's CLI call does not pay 1.5-3.5 s of imports (torch,
transformers) each time: over a full run that was about 13 of 59 worker-minutes.

Each call is still its own process, as `python -m enn_cluster.client.cli ARGS` would be:
forked from a pristine parent that never ran a command, with the call's environment, cwd,
umask, stdin and pipes for stdout/stderr, running the module as `__main__`; its exit code is
the process's. What a fork cannot give is what a fresh interpreter reads while importing
(HOME for the Hugging Face cache, OMP_NUM_THREADS for torch's threads): a zygote serves
only calls whose environment equals its own in everything but the names below (read when a
command runs). Another environment takes a fresh interpreter, and its own zygote once it
comes again (a module whose tests all set OMP_NUM_THREADS, say).
The preload is only modules that print nothing on import (checked at start): a CLI still
prints, or quiets, what its own imports say.
"""
from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Optional

# Imported once in the zygote: silent on import (torchao, which transformers' modeling
# imports, logs; the CLI quiets it, so each command still imports that part itself).
PRELOAD = ("numpy", "yaml", "torch", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "safetensors.torch", "tokenizers", "pyarrow.parquet",
           "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.generation.utils",
           "transformers.models.llama.configuration_llama",
           "transformers.models.qwen2.configuration_qwen2",
           "enn_cluster.client.cli", "enn_cluster.client.prepare", "enn_cluster.client.doctor",
           "enn_cluster.models.causal_lm")
# Environment read when a command runs, never while importing: a call may differ in these.
# Ours and Slurm's; the tests' fakes; mlflow's (not preloaded: imported by the command);
# what pytest, torch's compiler and mlflow set in the test process as it goes.
RUNTIME_ENV = ("PATH", "TMPDIR", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
RUNTIME_PREFIXES = ("ENN_", "SLURM_", "FAKE_", "MLFLOW_", "_MLFLOW_", "TORCHELASTIC_")
MODULE = "enn_cluster.client.cli"


def _send(sock: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def _recv(sock: socket.socket):
    """(message or None at EOF, fds that came with it)."""
    head, fds, _, _ = socket.recv_fds(sock, 4, 8)
    if not head:
        return None, fds
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---------------------------------------------------------------------------------------
# The zygote's side


def _preload() -> str:
    """Import PRELOAD; what the imports printed (nothing, or the zygote is not used)."""
    import importlib
    import tempfile

    with tempfile.TemporaryFile() as out:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported, and the zygote then unused
            print(f"preload failed: {exc!r}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        printed = out.read().decode(errors="replace")
    # as under -m: the command's module runs as __main__, not found already imported
    del sys.modules[MODULE]
    delattr(sys.modules["enn_cluster.client"], "cli")
    return printed


def _child(sock: socket.socket, req: dict, fds: list[int]) -> None:
    """Become `python -m enn_cluster.client.cli ARGS`; never returns to the serving loop
    (the module's SystemExit or exception ends this process as it ends an interpreter)."""
    import runpy
    import tempfile

    sock.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # TMPDIR is read again, as a fresh interpreter would
    sys.argv = [MODULE, *req["args"]]
    sys.orig_argv = [sys.executable, "-m", MODULE, *req["args"]]
    sys.path[0] = req["cwd"]  # -m puts the cwd first
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sys.path[0] = os.getcwd()  # not tests/: a user's interpreter does not see it
    _send(sock, {"printed": _preload()})
    while True:
        req, fds = _recv(sock)
        if req is None:
            return
        pid = os.fork()
        if pid == 0:
            _child(sock, req, fds)
        for fd_ in fds:
            os.close(fd_)
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"returncode": os.waitstatus_to_exitcode(status)})


# ---------------------------------------------------------------------------------------
# The tests' side


def import_env(env: dict) -> tuple:
    """The part of `env` a fresh interpreter may read while importing."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in RUNTIME_ENV and not k.startswith(RUNTIME_PREFIXES)))


class Zygote:
    """Started with the environment of the calls it serves; ends when the test process
    does, or when it is dropped (its socket closes)."""

    def __init__(self, env: dict, cwd: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        ready, _ = _recv(ours)
        self.usable = bool(ready) and not ready["printed"]

    def close(self) -> None:
        self.sock.close()
        self.proc.wait()

    def run(self, args: list[str], env: dict, cwd: str,
            timeout: Optional[float]) -> subprocess.CompletedProcess:
        """As subprocess.run(..., capture_output=True, text=True, timeout=timeout)."""
        umask = os.umask(0o022)
        os.umask(umask)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        _send(self.sock, {"args": args, "env": env, "cwd": cwd, "umask": umask},
              [0, out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        pid = _recv(self.sock)[0]["pid"]
        chunks: dict[int, bytes] = {}

        def drain(fd: int) -> None:
            with os.fdopen(fd, "rb") as f:
                chunks[fd] = f.read()

        readers = [threading.Thread(target=drain, args=(fd,), daemon=True)
                   for fd in (out_r, err_r)]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        timed_out = any(t.is_alive() for t in readers)
        if timed_out and not select.select([self.sock], [], [], 0)[0]:
            os.kill(pid, signal.SIGKILL)  # not once the zygote reaped it (its pid may be reused)
            for t in readers:
                t.join()
        code = _recv(self.sock)[0]["returncode"]
        out, err = (io.TextIOWrapper(io.BytesIO(chunks[fd])).read() for fd in (out_r, err_r))
        cmd = [sys.executable, "-m", MODULE, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, code, out, err)


_ZYGOTES: dict[tuple, Zygote] = {}  # by import_env, the most recently used last
_SEEN: dict[tuple, int] = {}
_KEEP = 2
_START = threading.Lock()


def _zygote(env: dict) -> Optional[Zygote]:
    """The zygote for `env`: started at the session's first call, and for another
    environment at its second; the least recently used beyond _KEEP is dropped."""
    key = import_env(env)
    with _START:
        z = _ZYGOTES.pop(key, None)
        if z is not None and z.proc.poll() is not None:
            z = None
        _SEEN[key] = _SEEN.get(key, 0) + 1
        if z is None and (len(_SEEN) == 1 or _SEEN[key] > 1):
            z = Zygote(env, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if z is None:
            return None
        _ZYGOTES[key] = z
        for old in list(_ZYGOTES)[:-_KEEP]:
            if _ZYGOTES[old].lock.acquire(blocking=False):  # not while it serves a call
                _ZYGOTES.pop(old).close()
    return z if z.usable else None


def run_cli(args: list[str], env: dict, cwd: str,
            timeout: Optional[float]) -> Optional[subprocess.CompletedProcess]:
    """`enn-submit ARGS` forked from a zygote; None when none serves `env` yet, or the one
    that does is busy with another thread's call: the caller then starts a fresh
    interpreter."""
    if os.environ.get("ENN_TEST_FRESH_CLI") == "1":
        return None
    z = _zygote(env)
    if z is None or not z.lock.acquire(blocking=False):
        return None
    try:
        return z.run(args, env, cwd, timeout)
    finally:
        z.lock.release()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
