"""One rendezvous port rule (config/launch_env.py) on both sides: the host snippet every
batch script runs and the worker's fallback for a site's own srun line derive the same
MASTER_PORT from a job id. The snippet's arithmetic runs for real under bash."""
from __future__ import annotations

import re
import subprocess

import pytest

from enn_cluster.cluster import job_script
from enn_cluster.config.launch_env import MASTER_PORT_BASE, MASTER_PORT_SPAN
from enn_cluster.worker.environment import port_for_job
from render_support import TEMPLATES


def _snippet_port(job_id: str, run_dir) -> int:
    """The port the rendered host snippet derives for `job_id` (before passing over a port
    something on this machine already listens on: the first one it tried)."""
    script = "\n".join(job_script.host_setup_lines()) + '\nprintf "%s" "$MASTER_PORT"\n'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job_id,
                               "ENN_RUN_DIR": str(run_dir), "ENN_MAX_RESTARTS": "0"})
    assert done.returncode == 0, done.stderr
    taken = re.search(r"enn: port (\d+) is taken", done.stderr)
    return int(taken.group(1) if taken else done.stdout)


@pytest.mark.parametrize("job_id", ["1", "4242", "0042", "9999", "10000", "29999",
                                    "123456789012"])
def test_host_snippet_and_worker_derive_one_port(tmp_path, job_id):
    port = _snippet_port(job_id, tmp_path)
    assert port == port_for_job(job_id)
    assert MASTER_PORT_BASE <= port < MASTER_PORT_BASE + MASTER_PORT_SPAN


def test_the_snippet_takes_its_numbers_from_the_one_rule():
    raw = (TEMPLATES / "host_setup.sh").read_text()
    rendered = "\n".join(job_script.host_setup_lines())
    assert str(MASTER_PORT_BASE) not in raw and str(MASTER_PORT_SPAN) not in raw
    assert "@MASTER_PORT_BASE@" in raw and not re.search(r"@[A-Z][A-Z0-9_]*@", rendered)
