"""bench/device_check.sh, the one-GPU check run whenever a GPU is lent, kept runnable where
none is: the same flow on the CPU (DC_GPUS=0 DC_SMALL=1 DC_COMPILE=false) calls the same
package functions, so an API it uses cannot change unseen between GPU sessions (the copy in
../shared had drifted: its optimizer stand-in lacked the Adam fields new_optimizer reads)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT
from render_support import shellcheck

SCRIPT = ROOT / "bench" / "device_check.sh"
CHECKS = ("import_check", "placement", "fabric_memlock", "accelerator_lane",
          "fused_adamw_found_inf", "compile_ac_grads", "train_full", "full_losses",
          "master_weights_fp32", "resume_record", "predict_output", "doctor", "train_lora",
          "lora_checkpoint", "chunked_loss_equal", "full_worker_forked", "lora_worker_forked",
          "train_float8", "float8_report", "float8_weights_fp32", "float8_losses")


def test_script_passes_shellcheck():
    shellcheck(SCRIPT)


@pytest.mark.slow  # the whole flow: train, resume, predict, LoRA (about 90 s on 2 cores)
def test_device_check_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable, "DC_GPUS": "0",
           "DC_SMALL": "1", "DC_COMPILE": "false", "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    log = (tmp_path / "out" / "log.txt").read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    failed = [line for line in summary.splitlines() if line.startswith("FAIL")]
    assert not failed, failed + [log[-3000:]]
    passed = {line.split()[1] for line in summary.splitlines() if line.startswith("PASS")}
    assert set(CHECKS) <= passed, sorted(set(CHECKS) - passed)
    assert summary.splitlines()[-1].endswith(" 0 FAIL"), summary[-300:]
