"""`make demo-llm` runs end to end (issue 24 section 6), and it runs every command that
docs/quickstart.md's LM section shows: train LoRA on 2 ranks, resume on 1, score and continue
text, collect, export --format hf, which transformers then loads."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

from helpers import ROOT


def _section_commands() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    section = text.split("## 8. Fine-tune a Hugging Face model")[1].split("\n## ")[0]
    block = section.split("```bash")[1].split("```")[0]
    out = []
    for line in block.strip().splitlines():
        words = line.split()
        assert words[0] == "enn-submit", line
        out.append((words[1], sorted(w for w in words if w.startswith("--"))))
    return out


def test_demo_llm_runs_the_quickstart_commands_end_to_end(tmp_path):
    env = dict(os.environ, ENN_DEMO_RUNS=str(tmp_path / "runs"), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.demo_llm"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    ran = [line.split() for line in res.stdout.splitlines() if line.startswith("$ enn-submit ")]
    for command, flags in _section_commands():
        assert any(words[2] == command and set(flags) <= set(words) for words in ran), \
            (command, flags, ran)
    loss = re.search(r"loss: first step ([0-9.]+), last step ([0-9.]+)", res.stdout)
    assert loss and float(loss.group(2)) < float(loss.group(1)), res.stdout[-2000:]
    run = next(p for p in (tmp_path / "runs").iterdir() if p.name.startswith("llm-2"))
    scores, made = np.load(run / "scores.npy"), np.load(run / "continued.npy")
    assert scores.shape == (3, 2) and (scores[:, 0] < 0).all() and (scores[:, 1] > 0).all()
    assert made.shape == (3, 8) and (made[:, 0] >= 0).all()
    assert "transformers loads the export" in res.stdout
