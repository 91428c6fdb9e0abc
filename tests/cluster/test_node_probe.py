"""Issue 37 section 3: after a lost node the batch shell's probe (host_setup.sh,
enn_probe_nodes) decides once the answers stop coming, not when the dead node's srun times
out. The rendered snippet runs under bash with srun as a stub that answers for each node
after a delay of its own, or never (a node without power: its srun waits until killed)."""
from __future__ import annotations

import subprocess

import pytest

from enn_cluster.cluster import job_script

SRUN = """#!/bin/bash
for arg in "$@"; do case "$arg" in --nodelist=*) node=${arg#--nodelist=} ;; esac; done
delay=$(sed -n "s/^$node=//p" "$STUB/answers")
[ "$delay" != never ] || exec sleep 600  # the probe must end it, not wait for it
sleep "$delay"
"""


def _probe(tmp_path, answers: dict, need: int, self: str) -> list[str]:
    """The nodes `enn_probe_nodes` says answered, each node's stub answering after
    answers[node] seconds ("never": not at all). ENN_PROBE_S is ten minutes: a probe that
    waited for the silent node would run past the subprocess timeout."""
    stub = tmp_path / "stub"
    (stub / "bin").mkdir(parents=True)
    (stub / "bin" / "srun").write_text(SRUN)
    (stub / "bin" / "srun").chmod(0o755)
    (stub / "answers").write_text("".join(f"{n}={d}\n" for n, d in answers.items()))
    script = "\n".join([*job_script.host_setup_lines(),
                        f'enn_probe_nodes {need} "{self}" {" ".join(answers)}'])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{stub / 'bin'}:/usr/bin:/bin", "STUB": str(stub),
                               "SLURM_JOB_ID": "7", "ENN_RUN_DIR": str(tmp_path / "run"),
                               "ENN_MAX_RESTARTS": "0", "MASTER_PORT": "1",
                               "ENN_PROBE_S": "600"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_node_answering_late_within_the_grace_counts_alive_and_the_silent_one_is_lost(
        tmp_path):
    """The own node n1 answers at once (the minimum, 1, is met); n2 answers half a second
    later, inside the grace of at least 1 s after the newest answer; n3 never answers. The
    probe names n1 and n2 without waiting for n3's srun."""
    assert _probe(tmp_path, {"n1": 0, "n2": 0.5, "n3": "never"}, need=1, self="n1") == \
        ["n1", "n2"]


def test_the_probe_waits_for_its_own_node_before_deciding(tmp_path):
    """n1 and n3 answer at once (the minimum, 2, is met), but the shell's own node n2 is
    slow to answer: the probe waits for it rather than call it lost."""
    assert _probe(tmp_path, {"n1": 0, "n2": 2, "n3": 0}, need=2, self="n2") == \
        ["n1", "n2", "n3"]


@pytest.mark.parametrize("took_ms, grace_ms", [(0, 1000), (400, 1000), (1000, 1000),
                                               (4500, 4500), ("0900", 1000)])
def test_the_grace_is_as_long_again_as_the_answers_took_and_at_least_a_second(took_ms,
                                                                             grace_ms):
    """A slow controller slows every answer: the wait for more grows with them (a leading
    zero is read as decimal, as every number the shell reads)."""
    script = "\n".join([*job_script.host_setup_lines(), f"enn_probe_grace_ms {took_ms}"])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "MASTER_PORT": "1",
                               "ENN_RUN_DIR": "/nonexistent/run", "ENN_MAX_RESTARTS": "0"})
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == grace_ms
