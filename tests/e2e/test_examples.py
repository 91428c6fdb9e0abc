"""The API quickstart example runs as a user would run it: train, predict, plot."""
from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT


def test_api_quickstart_trains_predicts_and_plots(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "api_quickstart.py"),
                           "--quick", "--runs-root", str(tmp_path)],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    mse, var = map(float, re.search(r"test MSE ([\d.]+) \(target variance ([\d.]+)\)",
                                    done.stdout).groups())
    assert mse < var  # it learned something; the example is not decoration
    png = re.search(r"plot: (\S+)", done.stdout).group(1)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
