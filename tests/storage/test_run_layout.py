"""The run directory's layout table (storage/layout.py) is the one place its names live:
the batch shell's requeue/ markers are filled in from it, and what runs write is in it
(tests/helpers.outside_layout, asserted after real local and Slurm runs)."""
from __future__ import annotations

import re

from enn_cluster.cluster import job_script
from enn_cluster.cluster.job_script import _template
from enn_cluster.storage import layout


def test_the_batch_shell_spells_no_marker_name_of_its_own():
    code = [line for line in _template("host_setup.sh").splitlines()
            if not line.lstrip().startswith("#")]
    assert [line for line in code if "requeue/" in line or re.search(
        r"(refused|failures|stop|probing|decision|relaunch|ended)-\$", line)] == []


def test_the_batch_shell_uses_every_marker_of_the_table_and_no_other():
    text = "\n".join(line for line in job_script.host_setup_lines()
                     if not line.lstrip().startswith("#"))
    used = set(re.findall(r'\$ENN_RUN_DIR/requeue/([a-z]*-?)\$(?:SLURM_JOB_ID|enn_lock_job)',
                          text))
    assert used == set(layout.MARKERS.values())
    assert re.findall(r"@[A-Z_]+@", text) == []  # every placeholder filled


def test_a_marker_path_is_the_table_s_name_under_requeue(tmp_path):
    assert layout.marker(tmp_path, "ended", 42) == tmp_path / "requeue" / "ended-42"
    assert layout.marker(tmp_path, "requeue", 42) == tmp_path / "requeue" / "42"
    names = [entry.name for entry in layout.LAYOUT]
    assert len(names) == len(set(names))
    for prefix in layout.MARKERS.values():
        assert f"{layout.REQUEUE}/{prefix}<job>" in names, prefix
