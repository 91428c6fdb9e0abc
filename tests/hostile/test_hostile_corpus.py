"""The hostile-input corpus (tests/hostile_cases.py), run in this process through the CLI's
own `main`: each case ends with its exit code and one error line naming the field, no
traceback, nothing written or changed on disk, and no MARKER file from an injected command."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import traceback
from pathlib import Path

import numpy as np
import pytest

from enn_cluster.client.cli import main
from helpers import cli, controller_up_scontrol, train_tiny
from hostile_cases import ALL

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A trained run with a committed 3-chunk prediction named p."""
    tmp = tmp_path_factory.mktemp("corpus")
    run = train_tiny(tmp, "h")
    np.save(tmp / "in.npy", np.zeros((40, 8), np.float32))
    done = cli("predict", run, "--input", tmp / "in.npy", "--name", "p", "--chunk-rows", "16")
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def _tree(root: Path) -> dict:
    """Every path under root with its type, mode, size and mtime (FIFOs are never opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode,
                                                st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                                                st.st_mtime_ns if stat.S_ISREG(st.st_mode) else 0)
    return out


def _run(argv: list, cwd: Path) -> tuple[object, str]:
    err, out = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
            except BaseException:  # noqa: BLE001 - the corpus reports it as a traceback
                err.write("Traceback (in-process)\n" + traceback.format_exc())
                code = "raised"
    finally:
        os.chdir(old)
    return code, err.getvalue()


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_hostile_input(case, tmp_path, template, monkeypatch):
    monkeypatch.delenv("ENN_SITE_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    d, run = tmp_path / "d", tmp_path / "run"
    d.mkdir()
    if any("{run}" in a for a in case.argv):
        shutil.copytree(template, run, symlinks=True)
    if case.setup is not None:
        case.setup(d, run)
    answers = tmp_path / "slurm-answers"  # `--cluster slurm` checks the controller first;
    answers.mkdir()                      # these cases are about what comes after
    controller_up_scontrol(answers)
    monkeypatch.setenv("PATH", f"{answers}{os.pathsep}{os.environ['PATH']}")
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value.replace("{d}", str(d)))
    before = _tree(tmp_path)
    argv = [a.replace("{d}", str(d)).replace("{run}", str(run)) for a in case.argv]
    code, err = _run(argv, d)
    assert "Traceback" not in err, err[-3000:]
    assert code == case.code, err[-2000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and case.field in errors[0], err[-2000:]
    assert "SECRETPW" not in err
    assert not list(tmp_path.rglob("MARKER")), "an injected command ran"
    assert _tree(tmp_path) == before, "the case changed files on disk"
