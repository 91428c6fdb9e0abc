"""The package shows the runtime flow: imports go one way between the sides, and no module
imports another that (directly or not) imports it back. Lazy imports inside functions count:
they are edges all the same, only later."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "enn_cluster"

# Which side may import which. The package root exposes the client's API lazily; the
# cluster names the one function every Slurm task runs (submitit pickles it by reference).
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
NAMED_EDGES = {("enn_cluster.cluster.submit_slurm", "enn_cluster.worker.slurm_entry")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def side(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports_of(path: Path, modules: set) -> set:
    """enn_cluster modules `path` imports (a `from X import name` of a submodule counts
    as importing the submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; imports are absolute, one way")
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "enn_cluster":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "enn_cluster"]
        out.update(n for n in names if n in modules and n != "enn_cluster")
    return out


def graph() -> dict:
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    return {m: imports_of(p, set(paths)) for m, p in paths.items()}


def test_imports_go_one_way_between_sides():
    wrong = sorted(f"{m} -> {d}" for m, deps in graph().items() for d in deps
                   if side(d) != side(m) and side(d) not in ALLOWED[side(m)]
                   and (m, d) not in NAMED_EDGES and not d.endswith("__init__"))
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


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
    assert top == ["__init__", "errors", "models"], top
