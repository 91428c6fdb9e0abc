"""The watchdog ends a rank that makes no progress (exit 70, with where each lane was), but
gives a phase known to be slow once, the first step of a compiled model, its own longer
deadline: a cold torch.compile is not a hang (issue 39 section 3). A real thread in a real
process, which os._exit ends."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

SCRIPT = textwrap.dedent("""
    import sys, time
    from enn_cluster.worker.watchdog import Progress, Watchdog
    progress = Progress()
    Watchdog(progress, 0.5, sys.stdout).start()
    progress.at("accelerator", "step 1: forward/backward")
    with progress.longer(30.0):
        time.sleep(3.0)  # six limits without a beat: a first compiled step
    print("survived the first step", flush=True)
    progress.at("accelerator", "step 2: forward/backward")
    time.sleep(60.0)  # no beat, no grace: ended long before this returns
    print("not ended", flush=True)
""")


def test_a_first_compiled_step_gets_its_own_deadline_and_a_later_stall_does_not():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 70, (done.stdout, done.stderr)
    assert "survived the first step" in done.stdout and "not ended" not in done.stdout
    assert "watchdog: no progress for" in done.stderr and "step 2: forward/backward" in \
        done.stderr, done.stderr
    assert "for a first compiled step" not in done.stderr  # the grace ended with the step


def test_the_documented_grace_is_the_one_applied():
    from enn_cluster.config.docs import DESCRIPTIONS
    from enn_cluster.worker.watchdog import COMPILE_GRACE_S

    assert f"gets {COMPILE_GRACE_S:.0f} s more" in DESCRIPTIONS["parallel.watchdog_s"]
