"""Rendered batch scripts run for real under bash with stub `srun`/`scontrol` on PATH:
the argv srun receives proves the quoting (hostile strings arrive intact, nothing
executes) and that the template path and the submitit path launch the same worker with
the same flags; the host side requeues and retries as configured."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from enn_cluster.cluster import job_script
from enn_cluster.config import nccl
from enn_cluster.cluster.job_spec import JobSpec
from render_support import HOSTILE, TEMPLATES, golden_specs, make_submitit_script, shellcheck

SRUN_STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_ARGV"
env -0 > "$STUB_ENV"
if [ -n "${STUB_MARKER:-}" ]; then mkdir -p "${STUB_MARKER%/*}" && : > "$STUB_MARKER"; fi
exit "${STUB_RC:-0}"
"""
SCONTROL_STUB = """#!/bin/bash
printf '%s\\n' "$*" >> "$STUB_SCONTROL"
if [ "$1 $2" = "show hostnames" ] && [ -n "${STUB_HOSTS:-}" ]; then printf '%s\\n' $STUB_HOSTS; fi
"""


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


# -- running the scripts ------------------------------------------------------------------


def test_rendered_script_launches_the_worker_with_the_submitit_flags(stub, run_dir, image):
    spec = JobSpec(job_name="enn-demo", run_dir=run_dir, nodes=2, gpus_per_node=2, time=120,
                   container_image=image, container_mounts=("/shared/data:/data:ro",),
                   nccl_profile="efa")
    done = stub.run(job_script.render_batch_script(spec), LD_LIBRARY_PATH="/usr/lib/x")
    assert done.returncode == 0, done.stderr
    log = f"--output={run_dir}/logs/%x-%j-r0.log"
    assert stub.argv == [log, *job_script.srun_args(spec),
                         "python3", "-m", "enn_cluster.worker", run_dir, "--task", "train"]
    assert f"--container-mounts=/shared/data:/data:ro,{run_dir}:{run_dir}" in stub.argv
    env = stub.env
    assert env["FI_PROVIDER"] == "efa" and env["ENN_NCCL_PROFILE"] == "efa"
    assert env["MASTER_PORT"] == str(20000 + 4242 % 20000)
    assert env["LD_LIBRARY_PATH"] == "/usr/lib/x"  # the worker sets it at exec (exec_env)
    assert stub.scontrol == []


def test_render_admin_prints_the_template_filled_for_this_run(stub, tmp_path):
    """`enn-submit render RUN.yaml --admin`: the admin template with the run's values fixed
    (what a site that runs its own sbatch keeps); it passes shellcheck and starts the worker
    on the run directory with the sbatch lines the flags asked for."""
    import yaml
    from helpers import cli, small_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(small_config(tmp_path, "kept")))
    res = cli("render", cfg, "--admin", "--container", "none", "--nodes", "2",
              "--procs-per-node", "2", "--gpus-per-node", "0", "--cpus-per-task", "3",
              "--time", "45", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_dir = str(tmp_path / "runs" / "kept")
    assert not Path(run_dir).exists()  # a dry run
    text = res.stdout
    assert text.startswith("#!/bin/bash") and "# Rendered by enn-submit" in text
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=3",
                 "#SBATCH --time=45", f"ENN_RUN_DIR={shlex.quote(run_dir)}"):
        assert line in text.splitlines(), line
    (tmp_path / "kept.sbatch").write_text(text)
    shellcheck(tmp_path / "kept.sbatch")
    Path(run_dir).mkdir(parents=True)
    done = stub.run(text)
    assert done.returncode == 0, done.stderr
    assert stub.argv[-5:] == ["-m", "enn_cluster.worker", run_dir, "--task", "train"]


def test_rendered_script_keeps_user_nccl_settings(stub, run_dir):
    spec = JobSpec(job_name="j", run_dir=run_dir, nccl_profile="socket")
    stub.run(job_script.render_batch_script(spec), NCCL_SOCKET_IFNAME="eth7", NCCL_IB_DISABLE="")
    assert stub.env["NCCL_SOCKET_IFNAME"] == "eth7" and stub.env["NCCL_IB_DISABLE"] == ""
    assert stub.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_hostile_strings_arrive_intact(stub, run_dir, image):
    spec = JobSpec(job_name="j", run_dir=run_dir, task="predict", predict_name="täst.v1",
                   python=f"/opt/py {HOSTILE}", env={"ENN_NOTE": HOSTILE, "EMPTY": ""},
                   extra_srun_args=(f"--comment={HOSTILE}", "--cpu-bind=none"),
                   container_image=image, nccl_profile="none")
    text = job_script.render_batch_script(spec)
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
    done = stub.run(job_script.render_batch_script(spec), restart=restart, marker=marker, rc=75)
    assert done.returncode == 75
    assert stub.scontrol == ["requeue 4242"] and not marker.exists()
    assert "stopped with a checkpoint" in done.stderr


def test_host_side_retry_after_failures_up_to_max_restarts(stub, run_dir):
    """A failed step (a rank died) is retried at most max_restarts times; bad input never."""
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=2)
    (Path(run_dir) / "requeue").mkdir()
    script = job_script.render_batch_script(spec)
    seen = []
    for _ in range(3):
        done = stub.run(script, rc=1)
        seen.append(stub.scontrol)
    assert seen == [["requeue 4242"], ["requeue 4242"], []]
    assert "after 2 retries (limit 2)" in done.stderr
    (Path(run_dir) / "requeue" / "failures-4242").unlink()
    stub.run(script, rc=2)
    assert stub.scontrol == []


HOSTILE_COUNTS = ["failures[$(touch CANARY_count)]", "a[`touch CANARY_tick`]", "1+1",
                  "-1", "x", "", "9" * 40, "0x10", "$((1))", "1\n$(touch CANARY_nl)"]


@pytest.mark.parametrize("count", HOSTILE_COUNTS)
def test_retry_count_file_is_data_never_code(stub, run_dir, count):
    """The trap reads requeue/failures-JOB at run time: anything but digits is refused
    (said once, no requeue), never evaluated (a CANARY file would appear in cwd)."""
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=5)
    (Path(run_dir) / "requeue").mkdir()
    (Path(run_dir) / "requeue" / "failures-4242").write_text(count)
    done = stub.run(job_script.render_batch_script(spec), rc=1)
    assert stub.scontrol == [] and "does not hold a retry count" in done.stderr
    assert (Path(run_dir) / "requeue" / "failures-4242").read_text() == count


@pytest.mark.parametrize("plant", ["fifo", "symlink-file", "symlink-dir", "directory"])
def test_requeue_files_that_are_not_regular_neither_block_nor_leak(stub, run_dir, tmp_path, plant):
    """requeue/ is writable by the job: a FIFO as failures-JOB or refused-JOB is never opened
    (the trap would block until the time limit: the stub run's 30 s timeout fails the test),
    and the retry count is never written through a symlink to a file outside the run."""
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=5)
    requeue, outside = Path(run_dir) / "requeue", tmp_path / "outside"
    outside.mkdir()
    if plant == "symlink-dir":
        requeue.symlink_to(outside)
    else:
        requeue.mkdir()
    failures = requeue / "failures-4242"
    if plant == "fifo":
        os.mkfifo(failures)
    elif plant == "symlink-file":
        failures.symlink_to(outside / "count")
    elif plant == "directory":
        failures.mkdir()
    done = stub.run(job_script.render_batch_script(spec), rc=1)
    assert stub.scontrol == [], done.stderr
    assert not list(outside.iterdir()), "a write went through a symlink out of the run"
    if plant == "fifo":  # the step leaves a FIFO as its refusal note (the script's start
        assert "does not hold a retry count" in done.stderr  # removed any older one)
        (stub.bin / "srun").write_text(f"#!/bin/bash\nmkfifo {shlex.quote(str(requeue / 'refused-4242'))}\n")
        done = stub.run(job_script.render_batch_script(spec), rc=1)
        assert stub.scontrol == [] and "its note is not a regular file" in done.stderr


@pytest.mark.parametrize("job_id", ["1[$(touch CANARY_job)]", "x", "0x1", "42 43"])
def test_slurm_job_id_is_checked_before_arithmetic(stub, run_dir, job_id):
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=5)
    done = stub.run(job_script.render_batch_script(spec), rc=1, SLURM_JOB_ID=job_id)
    assert stub.scontrol == [] and "MASTER_PORT" not in stub.env
    assert "not a whole number; not requeueing" in done.stderr


def test_leading_zero_count_is_decimal(stub, run_dir):
    spec = JobSpec(job_name="j", run_dir=run_dir, max_restarts=9)
    (Path(run_dir) / "requeue").mkdir()
    (Path(run_dir) / "requeue" / "failures-4242").write_text("08\n")
    stub.run(job_script.render_batch_script(spec), rc=1)
    assert stub.scontrol == ["requeue 4242"]
    assert (Path(run_dir) / "requeue" / "failures-4242").read_text() == "9\n"


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
    python = argv.index(job_script.submitit_executor_kwargs(spec)["slurm_python"])
    pyxis_at = [i for i, a in enumerate(argv) if a.startswith(("--container-", "--no-container"))]
    assert pyxis_at and max(pyxis_at) < python
    assert argv[python + 1:python + 4] == ["-u", "-m", "submitit.core._submit"]
    assert "--kill-on-bad-exit=1" in argv[:python]
    assert stub.env["NCCL_IB_TIMEOUT"] == "22" and stub.env["ENN_NCCL_PROFILE"] == "ib"


def test_submitit_parameters_through_make_sbatch_string(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    spec = golden_specs()["train_elastic_registry_ib"]
    params = job_script.submitit_parameters(spec)
    renamed = {"name": "job_name", "timeout_min": "time", "tasks_per_node": "ntasks_per_node",
               "mem_gb": "mem"}
    kwargs = {renamed.get(k, k).removeprefix("slurm_"): v for k, v in params.items()}
    kwargs["mem"] = f"{kwargs['mem']}GB"
    text = _make_sbatch_string(command="python3 -u -m submitit.core._submit /f",
                               folder=str(tmp_path), **kwargs)
    for line in ("#SBATCH --nodes=2-4", "#SBATCH --requeue", "#SBATCH --signal=B:USR2@90",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --constraint=a100",
                 "#SBATCH --open-mode=append", "#SBATCH --account=ml",
                 "ENN_MIN_NODES=2", "ENN_GPUS_PER_NODE=8"):  # the shell's srun: 8 a node
        assert line in text
    # a range fixes no task count at submit (Slurm would grant MIN nodes only): one task per
    # node holding the CPUs of its 8
    assert "--ntasks-per-node" not in text.split("# setup")[0]
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.index("--container-image=") < srun.index("python3 -u -m submitit")
    path = tmp_path / "s.sbatch"
    path.write_text(text)
    shellcheck(path)


@pytest.mark.parametrize("granted", [2, 4])
def test_a_range_job_starts_its_tasks_on_every_node_granted(stub, run_dir, granted):
    """--nodes 2-4 at 8 tasks a node: whatever Slurm granted (SLURM_JOB_NUM_NODES), the
    batch shell's srun asks for 8 tasks on each of those nodes; the world size is that."""
    spec = JobSpec(job_name="enn-range", run_dir=run_dir, nodes="2-4", gpus_per_node=8)
    text = job_script.render_batch_script(spec)
    assert "#SBATCH --nodes=2-4" in text and "--ntasks-per-node" not in text.split("<<< sbatch")[0]
    done = stub.run(text, SLURM_JOB_NUM_NODES=str(granted),
                    SLURM_JOB_NODELIST=f"n[1-{granted}]", SLURM_CPUS_ON_NODE="64")
    assert done.returncode == 0, done.stderr
    argv = stub.argv
    assert argv[:3] == [f"--nodes={granted}", "--ntasks-per-node=8", f"--ntasks={granted * 8}"]
    assert stub.env["SRUN_CPUS_PER_TASK"] == "8"  # 64 CPUs / 8 tasks


@pytest.mark.parametrize("self_node,picked", [("n1", "n1,n2"), ("n2", "n2,n1")])
def test_spare_nodes_are_held_out_of_the_step(stub, run_dir, self_node, picked):
    """--nodes 2 --spare-nodes 1 at 8 tasks a node: sbatch asks for 3 nodes, no task count
    and --no-kill; the batch shell's srun runs the 16 tasks on two of them, its own node
    first (its watcher looks for the step's tasks there), and holds the third."""
    spec = JobSpec(job_name="enn-spare", run_dir=run_dir, nodes=2, spare_nodes=1,
                   gpus_per_node=8)
    text = job_script.render_batch_script(spec)
    head = text.split("<<< sbatch")[0]
    assert "#SBATCH --nodes=3" in head and "#SBATCH --no-kill" in head
    assert "--ntasks-per-node" not in head
    assert "ENN_MIN_NODES=2" in text and "ENN_SPARE_NODES=1" in text
    done = stub.run(text, SLURM_JOB_NUM_NODES="3", SLURM_JOB_NODELIST="n[1-3]",
                    STUB_HOSTS="n1 n2 n3", SLURMD_NODENAME=self_node, SLURM_CPUS_ON_NODE="64")
    assert done.returncode == 0, done.stderr
    assert stub.argv[:4] == ["--nodes=2", "--ntasks-per-node=8", "--ntasks=16",
                             f"--nodelist={picked}"]
    assert f"enn: training on {picked}, 1 spare node(s) held" in done.stderr
    params = job_script.submitit_parameters(spec)
    assert params["nodes"] == 3 and "tasks_per_node" not in params
    extra = params["slurm_additional_parameters"]
    assert extra["no-kill"] is True and "nodes" not in extra
    assert "ENN_SPARE_NODES=1" in params["slurm_setup"]
    ranged = job_script.submitit_parameters(JobSpec(job_name="enn-spare", run_dir=run_dir,
                                                  nodes="2-3", spare_nodes=2, gpus_per_node=8))
    assert ranged["nodes"] == 4 and ranged["slurm_additional_parameters"]["nodes"] == "4-5"


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
                    ENN_GPUS_PER_NODE="4", ENN_PYTHON="/opt/conda/bin/python",
                    SLURM_CPUS_ON_NODE="64")
    assert done.returncode == 0, done.stderr
    assert stub.env["SRUN_CPUS_PER_TASK"] == "16"  # 64 CPUs / 4 tasks
    spec = JobSpec(job_name="j", run_dir=run_dir, task="predict", predict_name="p",
                   container_image=image, container_mounts=("/d:/d:ro",),
                   extra_srun_args=("--cpu-bind=none", "--label"), python="/opt/conda/bin/python")
    assert stub.argv == [f"--output={run_dir}/logs/%x-%j-r0.log",
                         "--ntasks-per-node=4", *job_script.srun_args(spec),
                         *job_script.worker_command(spec)]
    assert stub.env["ENN_NCCL_PROFILE"] == "auto"


@pytest.mark.parametrize("job_env,expected", [
    ({"SLURM_CPUS_ON_NODE": "96"}, "12"),  # --exclusive (the template's): the node's 96 / 8
    ({"SLURM_CPUS_ON_NODE": "48", "SLURM_CPUS_PER_TASK": "6"}, "6"),  # #SBATCH --cpus-per-task=6
    ({"SLURM_CPUS_ON_NODE": "96", "SRUN_CPUS_PER_TASK": "3"}, "3"),  # the submitter's own
])
def test_admin_template_cpus_per_task(stub, run_dir, job_env, expected):
    done = stub.run((TEMPLATES / "train.sbatch").read_text(), ENN_RUN_DIR=run_dir,
                    ENN_GPUS_PER_NODE="8", **job_env)
    assert done.returncode == 0, done.stderr
    assert stub.env["SRUN_CPUS_PER_TASK"] == expected


@pytest.mark.parametrize("cpus_per_task,preset,expected", [
    (None, None, "12"),  # 96 CPUs on the node / 8 tasks
    (10, None, "10"),  # --cpus-per-task or site.cpus_per_task
    (None, "3", "3"),  # the submitter's own SRUN_CPUS_PER_TASK is kept
])
def test_cpus_per_task_reaches_srun(stub, run_dir, cpus_per_task, preset, expected):
    spec = JobSpec(job_name="j", run_dir=run_dir, gpus_per_node=8, cpus_per_task=cpus_per_task)
    extra = {"SRUN_CPUS_PER_TASK": preset} if preset else {}
    done = stub.run(job_script.render_batch_script(spec), SLURM_CPUS_ON_NODE="96", **extra)
    assert done.returncode == 0, done.stderr
    assert stub.env["SRUN_CPUS_PER_TASK"] == expected


def test_possibly_empty_arrays_expand_safely_on_old_bash():
    """bash < 4.4 (RHEL 7) treats "${a[@]}" of an empty array as unset under set -u: the
    extra srun arguments (empty unless given) expand through ${a[@]+"${a[@]}"}."""
    import re

    for name in ("train", "predict"):
        text = (TEMPLATES / f"{name}.sbatch").read_text()
        rendered = job_script.render_batch_script(JobSpec(job_name="j", run_dir="/r", task=name,
                                                        predict_name="p"))
        for script in (text, rendered):
            assert re.findall(r'(?<!\+)"\$\{enn_srun_extra\[@\]\}"(?!\})', script) == []
            assert '${enn_srun_extra[@]+"${enn_srun_extra[@]}"}' in script


def _two_free_ports_in_the_job_range() -> int:
    """A port P in 20000-29998 with P and P+1 free on loopback (this machine's other
    listeners decide which)."""
    import socket

    for port in range(24000, 29998):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.skip("no two free ports in 24000-29999 on loopback")


def test_a_taken_rendezvous_port_is_passed_over(stub, run_dir):
    """The port derived from the job id is taken on the first node: the batch shell
    exports the next free one for the workers (and says so)."""
    import socket

    port = _two_free_ports_in_the_job_range()
    script = job_script.render_batch_script(JobSpec(job_name="j", run_dir=run_dir))
    job_id = str(port - 20000 + 10000 * 7)  # the modulo folds it back onto `port`
    done = stub.run(script, SLURM_JOB_ID=job_id)
    assert done.returncode == 0, done.stderr
    assert stub.env["MASTER_PORT"] == str(port)  # free: the derived port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = stub.run(script, SLURM_JOB_ID=job_id)
    assert done.returncode == 0, done.stderr
    assert stub.env["MASTER_PORT"] == str(port + 1)
    assert f"enn: port {port} is taken on {socket.gethostname()}; trying the next one" \
        in done.stderr.splitlines()


@pytest.mark.slow
def test_a_prediction_staged_without_a_job_runs_from_the_admin_template(stub, tmp_path):
    """admin.md: `predict --prepare-only` stages NAME and starts nothing; predict.sbatch with
    the variables it prints and the CPU-only overrides (tasks per node from sbatch, no
    ENN_GPUS_PER_NODE) launches the worker on that prediction."""
    import numpy as np

    from helpers import cli, train_tiny
    from render_support import documented_cpu_only_flags

    run = train_tiny(tmp_path, "staged")
    np.save(tmp_path / "x.npy", np.ones((30, 8), np.float32))
    done = cli("predict", run, "--input", tmp_path / "x.npy", "--name", "holdout",
               "--prepare-only", "--nodes", "2", "--gpus-per-node", "8")
    assert done.returncode == 0 and done.stdout.strip() == "holdout", done.stderr
    assert f"ENN_RUN_DIR={run} ENN_PREDICT_NAME=holdout sbatch" in done.stderr, done.stderr
    assert (run / "predictions" / "holdout").is_dir()
    assert not list((run / "predictions" / "holdout").glob("chunk-*"))  # nothing ran
    assert [j["task"] for j in (json.loads(line) for line in
                                (run / "jobs.jsonl").read_text().splitlines())] == ["train"]
    flags = documented_cpu_only_flags()
    tasks = next(f.split("=")[1] for f in flags if f.startswith("--ntasks-per-node="))
    result = stub.run((TEMPLATES / "predict.sbatch").read_text(), ENN_RUN_DIR=str(run),
                      ENN_PREDICT_NAME="holdout", SLURM_NTASKS_PER_NODE=tasks)
    assert result.returncode == 0, result.stderr
    spec = JobSpec(job_name="j", run_dir=str(run), task="predict", predict_name="holdout")
    assert stub.argv[-len(job_script.worker_command(spec)):] == job_script.worker_command(spec)
    assert not any(a.startswith(("--ntasks-per-node", "--gpus")) for a in stub.argv)
