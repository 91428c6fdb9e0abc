"""Pyxis flags, JobSpec validation and rendered batch scripts.

Rendered scripts are pinned by golden files (ENN_UPDATE_GOLDEN=1 rewrites them) and
linted by shellcheck; tests/cluster/test_rendered_scripts_run.py runs them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enn_cluster.cluster import job_spec
from enn_cluster.cluster import job_script
from enn_cluster.config import nccl
from enn_cluster.cluster import pyxis
from enn_cluster.errors import UserError
from enn_cluster.cluster.job_spec import JobSpec
from render_support import GOLDEN, ROOT, TEMPLATES, golden_specs, make_submitit_script, shellcheck


# -- pyxis ------------------------------------------------------------------------------


def test_mounts_parse_and_print_in_pyxis_syntax():
    m = pyxis.parse_mount("/shared/data:/data:ro+rprivate")
    assert (m.src, m.dst, m.flags) == ("/shared/data", "/data", ("ro", "rprivate"))
    assert str(m) == "/shared/data:/data:ro+rprivate"
    assert [str(x) for x in pyxis.parse_mounts("/a:/a,/b:/c:ro")] == ["/a:/a", "/b:/c:ro"]


@pytest.mark.parametrize("text, message", [
    ("data:/data", "must be absolute"),
    ("/data", "is not SRC:DST"),
    ("/a:/b:ro:x", "is not SRC:DST"),
    ("/my data:/data", "contains ' '"),
    ("/a$(id):/a", "contains '\\$'"),
    ("/a\"b:/a", "contains '\"'"),
    ("/a:/b:fast", "unknown flags \\['fast'\\]"),
    ("/a:/b:", "unknown flags"),
    ("/a:/b:ro+rw", "both ro and rw"),
])
def test_bad_mounts_are_user_errors(text, message):
    with pytest.raises(UserError, match="--container-mounts: .*" + message):
        pyxis.parse_mount(text)


def test_image_arguments(tmp_path):
    assert pyxis.image_arg("img/a.sqsh", cwd="/work") == "/work/img/a.sqsh"
    assert pyxis.image_arg("img/a.sqsh", relative=True) == "./img/a.sqsh"
    assert pyxis.image_arg("/abs/a.sqsh", relative=True) == "/abs/a.sqsh"
    ref = "nvcr.io#nvidia/pytorch:24.05-py3"
    assert pyxis.image_arg(ref) == ref  # kept as is for srun
    assert pyxis.sbatch_escape_image(ref) == "nvcr.io\\#nvidia/pytorch:24.05-py3"
    for bad, message in (("docker://ubuntu", "drop 'docker://'"),
                         ("podman://localhost/x", "enroot import"),
                         ("img/a.sqsh", "relative path"), ("~/a.sqsh", "'~' is not expanded"),
                         ("ubuntu latest", "neither a squashfs path"),
                         ("../a.sqsh", "relative path")):
        with pytest.raises(UserError, match=message):
            pyxis.check_image(bad)
    with pytest.raises(UserError, match="leaves the job directory"):
        pyxis.image_arg("../a.sqsh", relative=True)


def test_container_flags_order_and_bare_metal():
    assert pyxis.srun_container_flags(None) == [] == pyxis.srun_container_flags("none")
    flags = pyxis.srun_container_flags("/i.sqsh", ["/a:/a:ro"], "/w", ["NCCL_DEBUG", "FI_PROVIDER"])
    assert flags == ["--container-image=/i.sqsh", "--container-mounts=/a:/a:ro",
                     "--container-workdir=/w", "--no-container-mount-home",
                     "--container-env=NCCL_DEBUG,FI_PROVIDER"]
    with pytest.raises(UserError, match="--container-env: 'A-B'"):
        pyxis.check_env_names(["A-B"])


# -- JobSpec validation -----------------------------------------------------------------


@pytest.mark.parametrize("over, message", [
    ({"job_name": "my job"}, "--job-name: 'my job' has characters"),
    ({"job_name": "a;$(id)"}, "--job-name"),
    ({"job_name": "logs/x"}, "--job-name"),
    ({"job_name": "j\n"}, "--job-name"),
    ({"partition": "gpu\n"}, "--partition"),
    ({"nodes": "²"}, "--nodes"),
    ({"env": {"A\n": "x"}}, "--env"),
    ({"container_image": "ubuntu\n"}, "--container-image"),
    ({"run_dir": "runs/r1"}, "RUN_DIR: run directory 'runs/r1' must be absolute"),
    ({"run_dir": "/runs/my run"}, "RUN_DIR: .*contains ' '"),
    ({"run_dir": "/runs/$(touch x)"}, "RUN_DIR: .*contains"),
    ({"run_dir": "/runs/`id`"}, "RUN_DIR: .*contains"),
    ({"run_dir": "/runs/a'b"}, "RUN_DIR: .*contains"),
    ({"run_dir": "/runs/r%j"}, "RUN_DIR: .*'%'"),
    ({"run_dir": "/runs/r1/"}, "RUN_DIR: .*trailing"),
    ({"task": "eval"}, "--task: 'eval' is not a task; use train or predict"),
    ({"task": "predict"}, "--name: predict needs a prediction name"),
    ({"task": "predict", "predict_name": "-rf"}, "--name: '-rf'"),
    ({"task": "predict", "predict_name": "a b"}, "--name: 'a b'"),
    ({"nodes": 0}, "--nodes: 0 is empty or below 1"),
    ({"nodes": "4-2"}, "--nodes: '4-2'"),
    ({"nodes": "two"}, "--nodes: 'two' is not a node count"),
    ({"gpus_per_node": -1}, "--gpus-per-node: -1 is not a whole number >= 0"),
    ({"time": "1h"}, "--time: '1h' is not a time"),
    ({"time": 2}, "--time: 2 leaves no run time before the USR2 warning"),
    ({"mem_gb": -1}, "--mem-gb"),
    ({"partition": "gpu;rm"}, "--partition"),
    ({"nccl_profile": "fast"}, "--nccl-profile: 'fast' is not an NCCL profile"),
    ({"container_mounts": ("/a:/a",)}, "--container-mounts: mounts or workdir given without"),
    ({"container_image": "/i.sqsh", "container_mounts": ("/a,b:/a",)}, "--container-mounts"),
    ({"container_image": "docker://x"}, "--container-image"),
    ({"env": {"A B": "x"}}, "--env: 'A B' is not an environment variable name"),
    ({"python": "python3\nrm -rf /"}, "--python: .*not one line"),
    ({"setup_lines": ("ok", "a\nb")}, r"setup_lines\[1\]: .*not one line"),
    ({"extra_sbatch_args": ("--comment=a b",)}, r"--sbatch-arg\[0\]: .*spaces, quotes"),
    ({"extra_sbatch_args": ("--comment=a#b",)}, r"--sbatch-arg\[0\]"),
    ({"extra_sbatch_args": ("--nodes=3",)}, r"--sbatch-arg\[0\]: --nodes is set by enn_cluster"),
    ({"extra_srun_args": ("--output=x",)}, r"--srun-arg\[0\]: .*set by enn_cluster"),
    ({"extra_srun_args": ("oops",)}, r"--srun-arg\[0\]: 'oops' is not an option"),
])
def test_bad_specs_name_the_flag(over, message):
    args = {"job_name": "j", "run_dir": "/shared/runs/r1", **over}
    with pytest.raises(UserError, match=message):
        JobSpec(**args)


def test_spec_normalises():
    spec = JobSpec(job_name="j", run_dir="/r", nodes="3", time="1-02:03:04",
                   container_image="none", setup_lines=["a"], gpus_per_node=0, procs_per_node=3)
    assert spec.container_image is None and spec.setup_lines == ("a",)
    assert spec.node_range == (3, 3) and spec.tasks_per_node == 3
    assert spec.time_minutes == 24 * 60 + 2 * 60 + 4  # seconds round up
    assert job_spec.time_minutes("90:30") == 91 and job_spec.time_minutes("2-6") == 54 * 60
    assert hash(spec) == hash(JobSpec(job_name="j", run_dir="/r", nodes=3, time="1-02:03:04",
                                      setup_lines=("a",), gpus_per_node=0, procs_per_node=3))


# -- templates and golden files -----------------------------------------------------------


@pytest.mark.parametrize("name", ["train_2x2_container", "predict_bare_metal_cpu",
                                  "train_elastic_registry_ib", "train_4x8_ib_whole_nodes"])
def test_golden_render(name):
    text = job_script.render_batch_script(golden_specs()[name])
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("ENN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}: run with ENN_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs: review, then ENN_UPDATE_GOLDEN=1"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    shellcheck(path)


def test_golden_submitit_script():
    text = make_submitit_script(golden_specs()["train_2x2_container"], "/shared/submitit/%j")
    path = GOLDEN / "submitit_train_2x2_container.sbatch"
    if os.environ.get("ENN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs: review, then ENN_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("request_, line", [
    ("gpus-per-node", "#SBATCH --gpus-per-node=8"), ("gres", "#SBATCH --gres=gpu:8"),
    ("gres:a100", "#SBATCH --gres=gpu:a100:8")])
def test_gpu_request_renders_in_both_scripts(request_, line):
    """site.gpu_request: sites without select/cons_tres ask for GPUs with --gres (issue 12)."""
    spec = JobSpec(job_name="j", run_dir="/r", gpus_per_node=8, gpu_request=request_)
    for text in (job_script.render_batch_script(spec), make_submitit_script(spec, "/r/slurm/%j")):
        gpu_lines = [x for x in text.splitlines() if x.startswith("#SBATCH --g")]
        assert gpu_lines == [line], text
    cpu = JobSpec(job_name="j", run_dir="/r", gpus_per_node=0, gpu_request=request_)
    assert "--g" not in "".join(x for x in job_script.render_batch_script(cpu).splitlines()
                                if x.startswith("#SBATCH"))


@pytest.mark.parametrize("task", ["train", "predict"])
def test_admin_templates(task):
    shipped = (TEMPLATES / f"{task}.sbatch").read_text()
    copy = ROOT / "slurm" / f"{task}.sbatch"
    generated = job_script.admin_template(shipped)  # the srun block from the submitit flag list
    if os.environ.get("ENN_UPDATE_GOLDEN") == "1":
        (TEMPLATES / f"{task}.sbatch").write_text(generated)
        shipped = generated
    assert shipped == generated, f"{task}.sbatch: srun block differs; review, then ENN_UPDATE_GOLDEN=1"
    # one file: the admins' slurm/ copy is a link to the package's template
    assert copy.is_symlink() and copy.resolve() == (TEMPLATES / f"{task}.sbatch").resolve()
    shellcheck(copy)
    host = "".join(f"{line}\n" for line in job_script.host_setup_lines())  # placeholders filled
    assert host in shipped, "the host-side snippet must be embedded verbatim"
    default = re.search(r'ENN_CONTAINER_ENV="\$\{ENN_CONTAINER_ENV:-([^}]*)\}"', shipped).group(1)
    assert default == ",".join(nccl.CONTAINER_ENV_NAMES)
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR2@90",
                 "#SBATCH --ntasks-per-node=8", "#SBATCH --exclusive"):
        assert line in shipped


def _block_names(text: str, block: str) -> set[str]:
    """Variables the block sets (NAME=, read -a NAME) or insists on ([ -n NAME ] || die)."""
    body = text.split(f"# >>> {block}")[1].split(f"# <<< {block}")[0]
    return set(re.findall(r"^(\w+)=", body, re.M) + re.findall(r"read -r -a (\w+)", body)
               + re.findall(r'^\[ -n "\$\{(\w+):-\}" \] \|\| enn_die', body, re.M))


@pytest.mark.parametrize("name", ["train_2x2_container", "predict_bare_metal_cpu"])
def test_rendered_parameters_match_the_template(name):
    spec = golden_specs()[name]
    template = (TEMPLATES / f"{spec.task}.sbatch").read_text()
    rendered = job_script.render_batch_script(spec)
    assert _block_names(rendered, "parameters") == _block_names(template, "parameters")
    strip = lambda t: re.sub(r"# >>> (\w+).*?# <<< \1", "", t, flags=re.S)  # noqa: E731
    assert strip(rendered) == strip(template), "only the marked blocks may differ"


def test_modules_do_not_import_torch():
    code = ("import sys, enn_cluster.cluster.job_spec, enn_cluster.cluster.site, enn_cluster.cluster.pyxis, "
            "enn_cluster.config.nccl; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=40)


@settings(max_examples=25, deadline=None, database=None)  # no .hypothesis/ in the tree
@given(values=st.lists(_TEXT, min_size=1, max_size=6),
       arg=_TEXT.filter(lambda t: "\n" not in t and "\r" not in t))  # one line: else refused
def test_any_text_survives_the_quoting(tmp_path_factory, values, arg):
    """Property: whatever text goes into an env value or an srun argument comes out of
    bash byte-for-byte (the lines as rendered, evaluated with a harmless printf)."""
    spec = JobSpec(job_name="j", run_dir="/r", env={f"V{i}": v for i, v in enumerate(values)},
                   extra_srun_args=(f"--comment={arg}",), nccl_profile="none")
    block = job_script.render_batch_script(spec).split("# >>> parameters\n")[1]
    lines = [line for line in block.split("\n# <<< parameters")[0].split("\n")
             if line.startswith("enn_srun_extra=")]
    lines += job_script.env_lines(spec)
    lines.append('printf "%s\\0" "${enn_srun_extra[@]}"' +
                 "".join(f' "$V{i}"' for i in range(len(values))))
    cwd = tmp_path_factory.mktemp("q")
    done = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split("\0")[:-1] == [f"--comment={arg}", *values]
    assert not any(cwd.iterdir())


def test_one_failure_retry_default_for_cli_and_admin_templates():
    """Issue 15 item 6: the CLI (parallel.max_restarts), JobSpec and slurm/*.sbatch agree."""
    from enn_cluster.config.run_config import ParallelConfig
    from enn_cluster.cluster.job_spec import DEFAULT_MAX_RESTARTS

    assert ParallelConfig().max_restarts == DEFAULT_MAX_RESTARTS
    for name in ("train.sbatch", "predict.sbatch"):
        text = (ROOT / "slurm" / name).read_text()
        assert f'ENN_MAX_RESTARTS="${{ENN_MAX_RESTARTS:-{DEFAULT_MAX_RESTARTS}}}"' in text
        assert f"ENN_MAX_RESTARTS ({DEFAULT_MAX_RESTARTS})" in text
