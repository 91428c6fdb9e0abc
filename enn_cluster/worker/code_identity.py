"""Which enn_cluster this is, as the login node records it at submit time and each Slurm
task checks it (issue 25): the job runs `slurm_entry.worker_entry` by import path, so an
image holding other enn_cluster code would run it silently. Light: no torch, no imports
from the package (the login node and the worker both call it first)."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional


def code_identity() -> str:
    """This enn_cluster: its version and a hash of its Python files (a dev install keeps
    one version across edits). The job runs `worker_entry` by import path, so the image
    must hold the same code as the login node that submitted it."""
    root = Path(__file__).resolve().parents[1]  # the enn_cluster package
    version = re.search(r'^__version__ = "([^"]+)"', (root / "__init__.py").read_text(), re.M)
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{version.group(1) if version else 'unknown'}+{digest.hexdigest()[:12]}"


def skew_problem(submitted: Optional[str], here: str) -> Optional[str]:
    """The one line a worker refuses with when it is not the code that was submitted."""
    if submitted is None or submitted == here:
        return None
    return (f"enn_cluster version skew: submitted with {submitted}, the job runs {here}; "
            "rebuild the image from this checkout (enn-submit build) or install the same "
            "enn_cluster in it, then resubmit")
