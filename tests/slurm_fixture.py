"""Pytest plugin: a real multi-node Slurm cluster on this machine (slurm/dev/cluster.sh).

Tests request the session-scoped ``slurm_cluster`` fixture. It brings the cluster up once in a
fresh state dir, points ``SLURM_CONF`` at it for the whole session, and takes it down at the
end (also after failures). Where the cluster cannot run (not root, tools missing, another
cluster up) the tests skip, except under ``CI=true``, where they fail instead.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_SH = os.path.join(ROOT, "slurm", "dev", "cluster.sh")
NODES = 2
EXIT_BUSY = 3  # cluster.sh: another state dir's cluster owns the bridge
REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "flock", "munged", "mungekey", "slurmctld",
                  "slurmd", "srun", "sbatch", "scontrol", "sinfo")
# Job states after which a job never runs again by itself.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


def _missing_requirement() -> str | None:
    """Why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, daemons)"
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t, path=search) is None]
    if missing:
        return f"missing {' '.join(missing)} (run slurm/dev/install-deps.sh as root)"
    return None


def _cannot_run(reason: str) -> None:
    """Skip, or fail loudly in CI, where these tests must run."""
    message = f"local Slurm cluster unavailable: {reason}"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: these tests must run)", pytrace=False)
    pytest.skip(message)


@dataclass
class SlurmCluster:
    """A running dev cluster: `env` is the environment for Slurm client subprocesses."""

    state_dir: str
    conf: str
    nodes: list[str]
    env: dict[str, str] = field(repr=False)
    pyxis: str | None = None  # None: no Pyxis; "0"/"1": Pyxis with use_squashfuse=0/1

    def run(self, args: str | Sequence[str], timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (text output captured, not checked) with a timeout."""
        if isinstance(args, str):
            args = shlex.split(args)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("env", self.env)
        return subprocess.run(list(args), timeout=timeout, **kw)

    def job_state(self, job_id: int | str) -> tuple[str, str]:
        """(JobState, full one-line `scontrol show job` text) for a job the controller knows."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=15)
        if proc.returncode != 0:
            raise LookupError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        # An array or het job prints one line per component; the first one decides.
        first = proc.stdout.splitlines()[0]
        fields = dict(f.split("=", 1) for f in first.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN"), proc.stdout

    def wait_job(self, job_id: int | str, states: str | Iterable[str] = ("COMPLETED",),
                 timeout: float = 60, poll_s: float = 0.25) -> str:
        """Poll until the job is in one of `states`; return that state.

        Raises AssertionError at once if the job reaches another final state (it would never
        get there), TimeoutError after `timeout` seconds; both include the job's details.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            state, text = self.job_state(job_id)
            if state in wanted:
                return state
            if state in FINAL_STATES:
                raise AssertionError(f"job {job_id} ended {state}, "
                                     f"wanted {sorted(wanted)}:\n{text}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout}s, "
                                   f"wanted {sorted(wanted)}:\n{text}")
            time.sleep(poll_s)

    def wait_idle(self, timeout: float = 90) -> None:
        """Until every node is idle: a --nodes MIN-MAX job takes only the nodes free when it
        starts, and the previous test's job or node may still be ending."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
            states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
            if proc.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nodes not idle after {timeout}s: {states or proc.stderr}")
            time.sleep(0.5)

    def release_requeued(self, job_id: int | str) -> None:
        """A requeued job waits ~2 min (BeginTime); start it now, as the notes advise."""
        self.wait_job(job_id, ("PENDING",), timeout=60)
        time.sleep(2)
        res = self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        assert res.returncode == 0, res.stderr

    def up(self, timeout: float = 300,
           ready_s: float | None = None) -> subprocess.CompletedProcess:
        """(Re)start the daemons. A node brought back after `node-down` is declared DOWN
        first (as Slurm would after SlurmdTimeout), so a job still COMPLETING on it ends at
        once; the wait is for the nodes to answer, longer on a loaded machine (`ready_s`,
        else $ENN_SLURM_UP_TIMEOUT, else 180 s)."""
        env = {k: v for k, v in os.environ.items() if k != "ENN_SLURM_PYXIS"}
        if ready_s is not None:
            env["ENN_SLURM_UP_TIMEOUT"] = str(int(ready_s))
        env.setdefault("ENN_SLURM_UP_TIMEOUT", "180")
        if self.pyxis is not None:
            env["ENN_SLURM_PYXIS"] = self.pyxis
        return _cluster_sh("up", self.state_dir, str(len(self.nodes)), timeout=timeout, env=env)

    def reconfigure(self, pyxis: str | None) -> None:
        """Restart the daemons with or without Pyxis (same state dir: job ids go on)."""
        if pyxis == self.pyxis:
            return
        down = self.down()
        assert down.returncode == 0, down.stderr
        self.pyxis = pyxis
        proc = self.up()
        if proc.returncode == EXIT_BUSY:
            pytest.skip(f"local Slurm cluster taken by another state dir: {proc.stderr.strip()}")
        assert proc.returncode == 0, f"cluster.sh up (pyxis={pyxis}):\n{proc.stderr}"

    def down(self, timeout: float = 120) -> subprocess.CompletedProcess:
        return _cluster_sh("down", self.state_dir, timeout=timeout)


def _cluster_sh(*args: str, timeout: float, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CLUSTER_SH, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _cluster_up_for(nodes: int):
    """A cluster of `nodes` nodes in a fresh state dir, SLURM_CONF pointed at it while it is
    up (the value before it is restored after), taken down at the end (also after failures)."""
    reason = _missing_requirement()
    if reason:
        _cannot_run(reason)
    # munged needs every parent of its socket searchable by all: /tmp, not pytest's 0700 tmp.
    state_dir = tempfile.mkdtemp(prefix="enn-slurm-", dir="/tmp")
    os.chmod(state_dir, 0o755)
    conf = os.path.join(state_dir, "slurm.conf")
    cluster = SlurmCluster(state_dir=state_dir, conf=conf,
                           nodes=[f"n{i}" for i in range(1, nodes + 1)],
                           env={**os.environ, "SLURM_CONF": conf})
    old_conf = os.environ.get("SLURM_CONF")
    finished = False
    try:
        proc = cluster.up()
        if proc.returncode == EXIT_BUSY:
            _cannot_run(proc.stderr.strip())
        if proc.returncode != 0:
            pytest.fail(f"cluster.sh up failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}",
                        pytrace=False)
        os.environ["SLURM_CONF"] = conf
        yield cluster
        finished = True
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        proc = cluster.down()
        if proc.returncode == 0 and not os.environ.get("ENN_KEEP_SLURM_STATE"):
            shutil.rmtree(state_dir, ignore_errors=True)
    # Only now, so that a failing teardown never masks the error that ended the session.
    if finished and proc.returncode != 0:
        pytest.fail(f"cluster.sh down failed; state kept in {state_dir}:\n{proc.stderr}",
                    pytrace=False)


@pytest.fixture(scope="session")
def slurm_cluster():
    yield from _cluster_up_for(NODES)


@pytest.fixture(scope="module")
def slurm_cluster3():
    """Three nodes, for a module whose jobs must lose one and keep MIN-MAX's minimum of 2
    (a cluster of its own, in its own network slot, beside the session's)."""
    yield from _cluster_up_for(3)
