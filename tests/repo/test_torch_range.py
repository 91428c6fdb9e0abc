"""The torch range in pyproject.toml is the one we test: optional torch APIs are
feature-detected, no private torch name is touched at import time, and the image and the
package declare the same floor. `make test-torch-floor` runs this file and the core tests
under the floor torch itself."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
import torch

from enn_cluster.storage import commits as store
from helpers import ROOT, cli, faults, full_params, metrics, small_config, write_config

PACKAGE = ROOT / "enn_cluster"
DOCKERFILE = ROOT / "containers" / "Dockerfile"


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


class _ImportTimeTorch(ast.NodeVisitor):
    """Dotted torch names a module reaches while it is imported: module and class bodies,
    decorators and defaults, but not function bodies (they run later, feature-detected)."""

    def __init__(self) -> None:
        self.aliases: dict = {}
        self.found: list = []

    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] == "torch":
                self.found.append((node.lineno, a.name))
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"

    def visit_ImportFrom(self, node):
        if (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                self.found.append((node.lineno, f"{node.module}.{a.name}"))
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def visit_Attribute(self, node):
        parts, inner = [], node
        while isinstance(inner, ast.Attribute):
            parts.insert(0, inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in self.aliases:
            self.found.append((node.lineno, ".".join([self.aliases[inner.id], *parts])))
        self.generic_visit(node)

    def _function(self, node):
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node):
        pass


def test_no_private_torch_name_is_touched_at_import_time():
    """A torch release may move or drop any private name; importing our modules (the
    worker imports most of them) must not depend on one."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        scan = _ImportTimeTorch()
        scan.visit(ast.parse(path.read_text(), str(path)))
        bad += [f"{path.name}:{line}: {name}" for line, name in scan.found if _private(name)]
    assert not bad, "private torch names used at import time:\n" + "\n".join(bad)


def test_the_scan_sees_what_it_must_refuse():
    """The scanner itself: the patterns this file must catch are caught."""
    code = ("import torch\nfrom torch.distributed._shard import x\nimport torch.a._b as c\n"
            "m = torch.storage._map()\nclass K:\n    y = c.z\n"
            "def f(a=torch._C):\n    return torch._hidden\n")
    scan = _ImportTimeTorch()
    scan.visit(ast.parse(code))
    assert [n for _, n in scan.found if _private(n)] == [
        "torch.distributed._shard.x", "torch.a._b", "torch.storage._map", "torch.a._b.z",
        "torch._C"]


_HIDE = '''
import os
from torch.distributed.checkpoint import staging
for name in ("DefaultStager", "StagingOptions"):
    if hasattr(staging, name):  # torch 2.8 and older never had them
        delattr(staging, name)
def log_pid():
    with open(os.environ["ENN_TEST_HIDDEN_LOG"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
log_pid()
os.register_at_fork(after_in_child=log_pid)  # a forked worker: a copy of a hidden torch
'''


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_without_optional_torch_apis_async_saves_and_resumes_take_the_stock_path(tmp_path,
                                                                                monkeypatch):
    """Every process (launcher and workers, started fresh or forked from the launcher)
    has DefaultStager and StagingOptions removed from torch, as on a torch that predates them (2.8 and older): async saves
    (staged by the product's own planner, worker/checkpoint_staging, which needs neither)
    still work, a rank death resumes from such a save, and the run ends
    bit-identical to a synchronous run on the full torch."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE)
    over = dict(parallel={"nodes": 1, "procs_per_node": 2}, training={"epochs": 1},
                checkpoint={"every_steps": 4, "keep_last": 20})
    plain = write_config(tmp_path / "plain.yaml", **small_config(tmp_path, "plain", **over))
    assert cli("train", "--config", plain).returncode == 0
    hidden = small_config(tmp_path, "hidden", **over)
    hidden["checkpoint"]["async_save"] = True
    log = tmp_path / "hidden.log"
    monkeypatch.setenv("PYTHONPATH", str(hide))  # helpers.cli puts the repo in front
    env = {"ENN_TEST_HIDDEN_LOG": str(log), **faults(fail_at_step=12, fail_rank=1)}
    res = cli("train", "--config", write_config(tmp_path / "hidden.yaml", **hidden),
              "--max-restarts", "1", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(log.read_text().split()) >= 5  # the launcher and two attempts of two ranks
    run = tmp_path / "runs" / "hidden"
    assert [r["step"] for r in metrics(run, "resume")] in ([4], [8])  # the async saves before 12
    assert any(r.get("async_save") for r in metrics(run, "checkpoint"))
    last = store.committed_steps(run / "checkpoints")[-1]
    assert last == store.committed_steps(tmp_path / "runs" / "plain" / "checkpoints")[-1]
    ours = full_params(store.step_dir(run / "checkpoints", last))
    theirs = full_params(store.step_dir(tmp_path / "runs" / "plain" / "checkpoints", last))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert cli("verify", run, env=env).returncode == 0


def _floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"torch>=([0-9.]+)"', text).group(1)


def _version(text: str) -> tuple:
    return tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", text).groups())


def test_the_installed_torch_is_inside_the_declared_range():
    assert _version(torch.__version__) >= _version(_floor()), (torch.__version__, _floor())


def _instructions(text: str) -> list:
    """The Dockerfile's instructions, continuation lines joined as the builder joins them."""
    return [line.strip() for line in re.sub(r"\\\n", "", text).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_base_ships_a_torch_inside_the_range_and_the_build_checks_it():
    """The default base's torch (named in the Dockerfile next to BASE_IMAGE) is at least
    the floor, and the build fails unless torch is inside the range, pip kept the image's
    torch, and the worker imports."""
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    shipped = re.search(r"^ARG BASE_TORCH=(\S+)$", text, re.M).group(1)
    assert base.startswith("nvcr.io/nvidia/pytorch:")
    assert _version(shipped) >= _version(_floor()), (base, shipped)
    assert f"ARG TORCH_FLOOR={_floor()}\n" in text
    runs = [i for i in _instructions(text) if i.startswith("RUN ")]
    install = next(i for i in runs if "pip install" in i)
    assert install.index("torch_floor_check") < install.index("pip install")
    assert "cmp -s - /tmp/torch-before" in install  # pip must not have replaced torch
    assert runs[-1].endswith("python3 -m enn_cluster.worker.import_check")  # nothing can mask it
    assert runs.index(install) < len(runs) - 1


@pytest.mark.parametrize("version, ok", [("2.10.0a0+b4e4ee81d3", True), ("2.9.1+cu128", True),
                                         ("2.9.0a0+50eac811a6", False), ("2.8.0", False),
                                         ("2.7.0a0", False), ("2.7.1+cu126", False)])
def test_the_image_floor_check_refuses_an_older_torch(tmp_path, version, ok):
    """The build step's own check, run against a torch that reports `version`."""
    import subprocess
    import sys

    install = next(i for i in _instructions(DOCKERFILE.read_text()) if "torch_floor_check" in i)
    code = re.search(r'python3 -c "(import re, sys, torch;.*?)"', install).group(1)
    (tmp_path / "torch.py").write_text(f"__version__ = {version!r}\n")
    done = subprocess.run([sys.executable, "-c", code.replace("${TORCH_FLOOR}", _floor())],
                          capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)})
    assert (done.returncode == 0) == ok, done.stderr
    if not ok:
        assert f"below the floor {_floor()}" in done.stderr


def test_the_import_check_imports_every_worker_module_and_names_a_broken_one(tmp_path):
    """The image build's last step: passes here; a worker module whose dependency is missing
    (a copy of the package with one such module) fails it, naming the module."""
    import shutil

    ok = subprocess.run([sys.executable, "-m", "enn_cluster.worker.import_check"],
                        capture_output=True, text=True, cwd=tmp_path,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ok.returncode == 0, ok.stderr
    from enn_cluster.worker.import_check import worker_modules

    count = len(worker_modules())
    assert count >= 20 and f"{count} worker modules import" in ok.stdout
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "enn_cluster", copy / "enn_cluster",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "enn_cluster" / "worker" / "zz_needs.py").write_text("import enn_missing_dependency\n")
    bad = subprocess.run([sys.executable, "-m", "enn_cluster.worker.import_check"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(copy)})
    assert bad.returncode == 1
    assert "enn_cluster.worker.zz_needs cannot be imported" in bad.stderr, bad.stderr
