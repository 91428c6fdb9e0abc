"""Pyxis flags, JobSpec validation, rendered batch scripts and submitit parameters.

Rendered scripts are pinned by golden files (ENN_UPDATE_GOLDEN=1 rewrites them), linted
by shellcheck, and run for real under bash with stub `srun`/`scontrol` on PATH: the argv
srun receives proves the quoting (hostile strings arrive intact, nothing executes) and
that the template path and the submitit path launch the same worker with the same flags.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enn_cluster import job_spec, nccl, pyxis
from enn_cluster.errors import UserError
from enn_cluster.job_spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
TEMPLATES = ROOT / "enn_cluster" / "templates"
HOSTILE = "a b 'c' \"d\" $(touch CANARY1) `touch CANARY2`; touch CANARY3 & ünï ✓ $PATH \\ *"

SRUN_STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_ARGV"
env -0 > "$STUB_ENV"
if [ -n "${STUB_MARKER:-}" ]; then mkdir -p "${STUB_MARKER%/*}" && : > "$STUB_MARKER"; fi
exit "${STUB_RC:-0}"
"""
SCONTROL_STUB = """#!/bin/bash
printf '%s\\n' "$*" >> "$STUB_SCONTROL"
"""

# -- helpers ----------------------------------------------------------------------------


def shellcheck(path: Path) -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is missing; CI must install it (apt-get install -y shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck); CI=true makes this fail")
    done = subprocess.run([exe, "-s", "bash", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


class Stubbed:
    """Runs a batch script under bash with stub srun/scontrol; records what they saw."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "stub-bin"
        self.bin.mkdir()
        for name, text in (("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.cwd = tmp / "cwd"
        self.cwd.mkdir()

    def run(self, script: str, restart=None, marker=None, rc=0, **env):
        path = self.tmp / "job.sbatch"
        path.write_text(script)
        full = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.tmp),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
                "STUB_ARGV": str(self.tmp / "argv"), "STUB_ENV": str(self.tmp / "env"),
                "STUB_SCONTROL": str(self.tmp / "scontrol.log"), "STUB_RC": str(rc), **env}
        if restart is not None:
            full["SLURM_RESTART_COUNT"] = str(restart)
        if marker:
            full["STUB_MARKER"] = str(marker)
        for f in ("argv", "env", "scontrol.log"):
            (self.tmp / f).unlink(missing_ok=True)
        done = subprocess.run(["bash", str(path)], cwd=self.cwd, env=full, capture_output=True,
                              text=True, timeout=30)
        canaries = sorted(p.name for p in self.cwd.iterdir() if p.name.startswith("CANARY"))
        assert not canaries, f"the script executed a hostile string: {canaries}"
        return done

    @property
    def argv(self) -> list[str]:
        return (self.tmp / "argv").read_text().split("\0")[:-1]

    @property
    def env(self) -> dict[str, str]:
        items = (self.tmp / "env").read_text().split("\0")[:-1]
        return dict(item.split("=", 1) for item in items)

    @property
    def scontrol(self) -> list[str]:
        log = self.tmp / "scontrol.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def stub(tmp_path):
    return Stubbed(tmp_path)


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "runs" / "träning-λ"  # unicode is fine: quoted, and legal in #SBATCH
    path.mkdir(parents=True)
    return str(path)


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "images" / "enn.sqsh"
    path.parent.mkdir()
    path.write_bytes(b"hsqs")
    return str(path)


def golden_specs():
    return {
        "train_2x2_container": JobSpec(
            job_name="enn-demo", run_dir="/shared/runs/demo", nodes=2, gpus_per_node=2,
            time="02:00:00", partition="gpu", exclusive=True, mem_gb=0, nccl_profile="efa",
            container_image="/shared/images/enn.sqsh",
            container_mounts=("/shared/datasets:/datasets:ro",)),
        "predict_bare_metal_cpu": JobSpec(
            job_name="enn-predict", run_dir="/shared/runs/demo", task="predict",
            predict_name="holdout", gpus_per_node=0, procs_per_node=4, cpus_per_task=2,
            time=30, nccl_profile="socket", python="/opt/venv/bin/python",
            setup_lines=("module load python/3.11",)),
        "train_elastic_registry_ib": JobSpec(
            job_name="enn-big", run_dir="/shared/runs/big", nodes="2-4", gpus_per_node=8,
            time="1-00:00:00", account="ml", qos="high", mem_gb=480, nccl_profile="ib",
            container_image="nvcr.io#nvidia/pytorch:24.05-py3", container_workdir="/workspace",
            container_mounts=("/shared/datasets:/datasets:ro+rprivate", "/scratch:/scratch"),
            env={"HF_HOME": "/shared/hf cache"}, extra_sbatch_args=("--constraint=a100",),
            extra_srun_args=("--cpu-bind=none",), max_restarts=5),
    }


def make_submitit_script(spec: JobSpec, folder: str) -> str:
    """submitit 1.5.4's own rendering of our parameters, through the real executor."""
    from submitit import AutoExecutor
    from submitit.slurm.slurm import SlurmExecutor

    original = SlurmExecutor.affinity
    SlurmExecutor.affinity = classmethod(lambda cls: 2)  # no srun needed to build a script
    try:
        executor = AutoExecutor(folder=folder, cluster="slurm",
                                **job_spec.submitit_executor_kwargs(spec))
    finally:
        SlurmExecutor.affinity = original
    executor.update_parameters(**job_spec.submitit_parameters(spec))  # rejects unknown names
    inner = executor._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "uid")


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
                                  "train_elastic_registry_ib"])
def test_golden_render(name):
    text = job_spec.render_batch_script(golden_specs()[name])
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


@pytest.mark.parametrize("task", ["train", "predict"])
def test_admin_templates(task):
    shipped = (TEMPLATES / f"{task}.sbatch").read_text()
    copy = ROOT / "slurm" / f"{task}.sbatch"
    assert copy.read_text() == shipped, f"slurm/{task}.sbatch must be a copy of {TEMPLATES.name}/"
    shellcheck(copy)
    host = (TEMPLATES / "host_setup.sh").read_text()
    assert host in shipped, "the host-side snippet must be embedded verbatim"
    default = re.search(r'ENN_CONTAINER_ENV="\$\{ENN_CONTAINER_ENV:-([^}]*)\}"', shipped).group(1)
    assert default == ",".join(nccl.CONTAINER_ENV_NAMES)
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=USR2@90",
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
    rendered = job_spec.render_batch_script(spec)
    assert _block_names(rendered, "parameters") == _block_names(template, "parameters")
    strip = lambda t: re.sub(r"# >>> (\w+).*?# <<< \1", "", t, flags=re.S)  # noqa: E731
    assert strip(rendered) == strip(template), "only the marked blocks may differ"


# -- running the scripts ------------------------------------------------------------------


def test_rendered_script_launches_the_worker_with_the_submitit_flags(stub, run_dir, image):
    spec = JobSpec(job_name="enn-demo", run_dir=run_dir, nodes=2, gpus_per_node=2, time=120,
                   container_image=image, container_mounts=("/shared/data:/data:ro",),
                   nccl_profile="efa")
    done = stub.run(job_spec.render_batch_script(spec), LD_LIBRARY_PATH="/usr/lib/x")
    assert done.returncode == 0, done.stderr
    log = f"--output={run_dir}/logs/%x-%j-r0.log"
    assert stub.argv == ["--kill-on-bad-exit=1", log, *job_spec.srun_args(spec)[1:],
                         "python3", "-m", "enn_cluster.worker", run_dir, "--task", "train"]
    assert f"--container-mounts=/shared/data:/data:ro,{run_dir}:{run_dir}" in stub.argv
    env = stub.env
    assert env["FI_PROVIDER"] == "efa" and env["ENN_NCCL_PROFILE"] == "efa"
    assert env["MASTER_PORT"] == str(20000 + 4242 % 20000)
    assert env["LD_LIBRARY_PATH"] == "/opt/amazon/efa/lib:/opt/aws-ofi-nccl/lib:/usr/lib/x"
    assert stub.scontrol == []


def test_rendered_script_keeps_user_nccl_settings(stub, run_dir):
    spec = JobSpec(job_name="j", run_dir=run_dir, nccl_profile="socket")
    stub.run(job_spec.render_batch_script(spec), NCCL_SOCKET_IFNAME="eth7", NCCL_IB_DISABLE="")
    assert stub.env["NCCL_SOCKET_IFNAME"] == "eth7" and stub.env["NCCL_IB_DISABLE"] == ""
    assert stub.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_hostile_strings_arrive_intact(stub, run_dir, image):
    spec = JobSpec(job_name="j", run_dir=run_dir, task="predict", predict_name="täst.v1",
                   python=f"/opt/py {HOSTILE}", env={"ENN_NOTE": HOSTILE, "EMPTY": ""},
                   extra_srun_args=(f"--comment={HOSTILE}", "--cpu-bind=none"),
                   container_image=image, nccl_profile="none")
    text = job_spec.render_batch_script(spec)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    done = stub.run(text)
    assert done.returncode == 0, done.stderr
    argv = stub.argv
    assert f"--comment={HOSTILE}" in argv and "--cpu-bind=none" in argv
    assert argv[argv.index("-m") - 1:] == [f"/opt/py {HOSTILE}", "-m", "enn_cluster.worker",
                                           run_dir, "--task", "predict", "--name", "täst.v1"]
    assert stub.env["ENN_NOTE"] == HOSTILE and stub.env["EMPTY"] == ""
    assert "--container-env=" + ",".join((*nccl.CONTAINER_ENV_NAMES, "ENN_NOTE", "EMPTY")) in argv


def test_hostile_strings_in_submitit_script(stub, run_dir, tmp_path):
    spec = JobSpec(job_name="j", run_dir=run_dir, python=f"/opt/py {HOSTILE}",
                   env={"ENN_NOTE": HOSTILE}, extra_srun_args=(f"--comment={HOSTILE}",))
    text = make_submitit_script(spec, str(tmp_path / "submitit"))
    done = stub.run(text)
    assert done.returncode == 0, done.stderr
    assert f"--comment={HOSTILE}" in stub.argv and f"/opt/py {HOSTILE}" in stub.argv
    assert stub.env["ENN_NOTE"] == HOSTILE


@pytest.mark.parametrize("restart", [None, 4, 50])
def test_host_side_requeue_after_a_checkpointed_stop(stub, run_dir, restart):
    """A stop with a checkpoint (marker) is always requeued: preemption is not a failure."""
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=0)
    marker = Path(run_dir) / "requeue" / "4242"
    done = stub.run(job_spec.render_batch_script(spec), restart=restart, marker=marker, rc=75)
    assert done.returncode == 75
    assert stub.scontrol == ["requeue 4242"] and not marker.exists()
    assert "stopped with a checkpoint" in done.stderr


def test_host_side_retry_after_failures_up_to_max_restarts(stub, run_dir):
    """A failed step (a rank died) is retried at most max_restarts times; bad input never."""
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=2)
    (Path(run_dir) / "requeue").mkdir()
    script = job_spec.render_batch_script(spec)
    seen = []
    for _ in range(3):
        done = stub.run(script, rc=1)
        seen.append(stub.scontrol)
    assert seen == [["requeue 4242"], ["requeue 4242"], []]
    assert "after 2 retries (limit 2)" in done.stderr
    (Path(run_dir) / "requeue" / "failures-4242").unlink()
    stub.run(script, rc=2)
    assert stub.scontrol == []


def test_submitit_script_requeues_on_the_host_too(stub, run_dir, image, tmp_path):
    spec = JobSpec(job_name="j", run_dir=run_dir, container_image=image, nodes=2,
                   gpus_per_node=2, nccl_profile="ib")
    text = make_submitit_script(spec, str(tmp_path / "submitit"))
    path = tmp_path / "submitit.sbatch"
    path.write_text(text)
    shellcheck(path)
    marker = Path(run_dir) / "requeue" / "4242"
    done = stub.run(text, marker=marker, rc=75)
    assert stub.scontrol == ["requeue 4242"] and not marker.exists(), done.stderr
    argv = stub.argv
    python = argv.index(job_spec.submitit_executor_kwargs(spec)["slurm_python"])
    pyxis_at = [i for i, a in enumerate(argv) if a.startswith(("--container-", "--no-container"))]
    assert pyxis_at and max(pyxis_at) < python
    assert argv[python + 1:python + 4] == ["-u", "-m", "submitit.core._submit"]
    assert "--kill-on-bad-exit=1" in argv[:python]
    assert stub.env["NCCL_IB_TIMEOUT"] == "22" and stub.env["ENN_NCCL_PROFILE"] == "ib"


def test_submitit_parameters_through_make_sbatch_string(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    spec = golden_specs()["train_elastic_registry_ib"]
    params = job_spec.submitit_parameters(spec)
    renamed = {"name": "job_name", "timeout_min": "time", "tasks_per_node": "ntasks_per_node",
               "mem_gb": "mem"}
    kwargs = {renamed.get(k, k).removeprefix("slurm_"): v for k, v in params.items()}
    kwargs["mem"] = f"{kwargs['mem']}GB"
    text = _make_sbatch_string(command="python3 -u -m submitit.core._submit /f",
                               folder=str(tmp_path), **kwargs)
    for line in ("#SBATCH --nodes=2-4", "#SBATCH --requeue", "#SBATCH --signal=USR2@90",
                 "#SBATCH --ntasks-per-node=8", "#SBATCH --constraint=a100",
                 "#SBATCH --open-mode=append", "#SBATCH --account=ml"):
        assert line in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.index("--container-image=") < srun.index("python3 -u -m submitit")
    path = tmp_path / "s.sbatch"
    path.write_text(text)
    shellcheck(path)


def test_admin_template_runs_from_environment_variables(stub, run_dir, image):
    template = (TEMPLATES / "predict.sbatch").read_text()
    done = stub.run(template)
    assert done.returncode == 2 and "enn: ENN_RUN_DIR is not set" in done.stderr
    done = stub.run(template, ENN_RUN_DIR=run_dir)
    assert done.returncode == 2 and "ENN_PREDICT_NAME is not set" in done.stderr
    done = stub.run(template, ENN_RUN_DIR=run_dir, ENN_PREDICT_NAME="p", SLURM_JOB_ID="")
    assert done.returncode == 2 and "not inside a Slurm job" in done.stderr
    done = stub.run(template, ENN_RUN_DIR="relative/run", ENN_PREDICT_NAME="p")
    assert done.returncode == 2 and "must be an absolute path" in done.stderr
    done = stub.run(template, ENN_RUN_DIR=run_dir, ENN_PREDICT_NAME="p", ENN_IMAGE="x.sqsh")
    assert done.returncode == 2 and "absolute or ./ path" in done.stderr
    done = stub.run(template, ENN_RUN_DIR=run_dir, ENN_PREDICT_NAME="p", ENN_IMAGE=image,
                    ENN_MOUNTS="/d:/d:ro", ENN_SRUN_ARGS="--cpu-bind=none --label",
                    ENN_GPUS_PER_NODE="4", ENN_PYTHON="/opt/conda/bin/python")
    assert done.returncode == 0, done.stderr
    spec = JobSpec(job_name="j", run_dir=run_dir, task="predict", predict_name="p",
                   container_image=image, container_mounts=("/d:/d:ro",),
                   extra_srun_args=("--cpu-bind=none", "--label"), python="/opt/conda/bin/python")
    assert stub.argv == ["--kill-on-bad-exit=1", f"--output={run_dir}/logs/%x-%j-r0.log",
                         "--ntasks-per-node=4", *job_spec.srun_args(spec)[1:],
                         *job_spec.worker_command(spec)]
    assert stub.env["ENN_NCCL_PROFILE"] == "auto"


def test_modules_do_not_import_torch():
    code = ("import sys, enn_cluster.job_spec, enn_cluster.site, enn_cluster.pyxis, "
            "enn_cluster.nccl; assert 'torch' not in sys.modules, 'torch imported'")
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
    block = job_spec.render_batch_script(spec).split("# >>> parameters\n")[1]
    lines = [line for line in block.split("\n# <<< parameters")[0].split("\n")
             if line.startswith("enn_srun_extra=")]
    lines += job_spec.env_lines(spec)
    lines.append('printf "%s\\0" "${enn_srun_extra[@]}"' +
                 "".join(f' "$V{i}"' for i in range(len(values))))
    cwd = tmp_path_factory.mktemp("q")
    done = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split("\0")[:-1] == [f"--comment={arg}", *values]
    assert not any(cwd.iterdir())
