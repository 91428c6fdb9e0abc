"""The one module that reaches into submitit: the private names and parameters it relies on
exist in the installed submitit, and pyproject.toml allows only the range that was tested."""
from __future__ import annotations

import tomllib
import types
from pathlib import Path

from packaging.requirements import Requirement

from enn_cluster.cluster import submitit_adapter
from enn_cluster.cluster.submitit_adapter import TESTED_RANGE, installed_version, surface_problems

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "enn_cluster"


def test_installed_submitit_has_every_private_name_we_call():
    assert surface_problems() == []


def test_installed_submitit_is_inside_the_tested_range_and_pyproject_says_it():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = [Requirement(d) for d in deps if Requirement(d).name == "submitit"]
    assert [str(r) for r in declared] == [str(Requirement(TESTED_RANGE))]
    spec = declared[0].specifier
    assert installed_version() in spec
    assert not spec.contains("1.6.0") and spec.contains("1.5.0")


def test_a_renamed_private_method_or_parameter_is_named():
    """What a submitit that changed its private surface would produce."""
    import submitit.slurm.slurm as real

    class Changed(real.SlurmExecutor):
        def _make_submission_file_text(self, command, job_uid):  # parameter renamed
            return ""

    slurm = types.SimpleNamespace(SlurmExecutor=Changed, _make_sbatch_string=None)
    fake = types.SimpleNamespace(slurm=types.SimpleNamespace(slurm=slurm),
                                 core=types.SimpleNamespace(utils=types.SimpleNamespace()))
    problems = surface_problems(fake)
    assert "submitit.slurm.slurm.SlurmExecutor._make_submission_file_text: no parameter uid" \
        in problems
    assert "submitit.slurm.slurm._make_sbatch_string: missing" in problems
    assert "submitit.core.utils.FailedJobError: missing" in problems
    assert not any("affinity" in p or "_convert_parameters" in p for p in problems)


def test_no_module_but_the_adapter_imports_submitit():
    """Every submitit call lives in cluster/submitit_adapter.py (comments may name it)."""
    import ast

    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "submitit" for n in names):
                found.append(path.relative_to(PACKAGE).as_posix())
    assert set(found) == {"cluster/submitit_adapter.py"}


def test_the_executor_builds_without_srun_and_patches_no_submitit_class(tmp_path, monkeypatch):
    from submitit.slurm.slurm import SlurmExecutor

    from enn_cluster.cluster.job_spec import JobSpec

    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch
    before = SlurmExecutor.__dict__["affinity"]
    spec = JobSpec(job_name="j", run_dir=str(tmp_path), wckey=None)
    executor = submitit_adapter.slurm_executor(spec, tmp_path / "slurm" / "%j")
    assert SlurmExecutor.__dict__["affinity"] is before
    assert SlurmExecutor.affinity() == -1  # submitit's own check is untouched
    text = submitit_adapter.batch_script(executor)
    assert "#SBATCH --job-name=j\n" in text and "--wckey" not in text
