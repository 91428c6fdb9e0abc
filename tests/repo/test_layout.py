"""The package shows the runtime flow: imports go one way between the sides, and no module
imports another that (directly or not) imports it back. Lazy imports inside functions count:
they are edges all the same, only later."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "enn_cluster"

# Which side may import which. The package root exposes the client's API lazily (so a module
# importing the root imports the client: `reached`); the cluster names the one function
# every Slurm task runs (submitit pickles it by reference).
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "models": {"config", "errors"},
    "storage": {"config", "errors"},
    "worker": {"storage", "config", "models", "errors"},
    "cluster": {"storage", "config", "errors"},
    "client": {"cluster", "storage", "config", "models", "errors"},
    "__init__": {"client"},
}
NAMED_EDGES = {("enn_cluster.cluster.submit_slurm", "enn_cluster.worker.slurm_entry"),
               # the run lock's owner may be a Slurm job; on bare metal the worker asks Slurm
               ("enn_cluster.worker.worker_lock", "enn_cluster.cluster.slurm"),
               # the local launcher forks its workers into the entry point's function
               ("enn_cluster.client.launch_local", "enn_cluster.worker.entry")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def side(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def reached(module: str) -> str:
    """The side an import of `module` reaches: the package root re-exports the client's API."""
    return "client" if module == "enn_cluster" else side(module)


def imports_of(path: Path, modules: set) -> set:
    """enn_cluster modules `path` imports, the package root included. `from X import name`
    imports the submodule X.name when there is one, else X itself (name is X's: a
    subpackage's __init__, or the root's lazy client API)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; imports are absolute, one way")
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "enn_cluster":
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                     else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "enn_cluster"]
        out.update(n for n in names if n in modules)
    return out


def graph() -> dict:
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    return {m: imports_of(p, set(paths)) for m, p in paths.items()}


def against_the_flow(g: dict) -> list:
    return sorted(f"{m} -> {d}" for m, deps in g.items() for d in deps
                  if reached(d) != side(m) and reached(d) not in ALLOWED[side(m)]
                  and (m, d) not in NAMED_EDGES)


def test_imports_go_one_way_between_sides():
    wrong = against_the_flow(graph())
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_the_check_sees_imports_of_the_root_and_of_packages(tmp_path):
    modules = {"enn_cluster", "enn_cluster.errors", "enn_cluster.worker",
               "enn_cluster.worker.slurm_entry", "enn_cluster.client", "enn_cluster.client.api"}
    source = tmp_path / "m.py"
    cases = {"from enn_cluster import train": {"enn_cluster"},
             "import enn_cluster": {"enn_cluster"},
             "from enn_cluster import errors": {"enn_cluster.errors"},
             "from enn_cluster.worker import slurm_entry": {"enn_cluster.worker.slurm_entry"},
             "from enn_cluster.worker import WORKER": {"enn_cluster.worker"},
             "from enn_cluster.client.api import train": {"enn_cluster.client.api"}}
    for line, expected in cases.items():
        source.write_text(line + "\n")
        assert imports_of(source, modules) == expected, line
    g = {"enn_cluster.storage.x": {"enn_cluster"}, "enn_cluster.worker.y": {"enn_cluster.client"},
         "enn_cluster.cluster.submit_slurm": {"enn_cluster.worker.slurm_entry"},
         "enn_cluster.client.z": {"enn_cluster"}, "enn_cluster": {"enn_cluster.client.api"}}
    assert against_the_flow(g) == ["enn_cluster.storage.x -> enn_cluster",
                                   "enn_cluster.worker.y -> enn_cluster.client"]


def test_no_import_cycle():
    g = graph()
    state: dict = {}
    cycles = []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [m, d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_a_few_modules_at_the_top():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert top == ["__init__", "errors"], top
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        ["client", "cluster", "config", "models", "storage", "worker"]


def test_only_the_gateway_runs_slurms_commands():
    """cluster/slurm.py is the one module that asks Slurm: no other module starts one of
    Slurm's query or control commands, or looks for one on PATH."""
    import re

    command = re.compile(r"""(?:\[\s*|which\(\s*)["'](scontrol|squeue|sacct|sinfo|scancel)["']""")
    found = sorted(f"{p.relative_to(PKG.parent)}: {m.group(1)}" for p in PKG.rglob("*.py")
                   if p.name != "slurm.py" or p.parent.name != "cluster"
                   for m in command.finditer(p.read_text()))
    assert not found, "Slurm asked outside cluster/slurm.py:\n" + "\n".join(found)
    assert command.search('client(["squeue", "-h"])') and command.search('which("sinfo")')
