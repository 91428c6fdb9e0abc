"""CPUs per task from the partition's nodes (issue 16 item 2): a job that is not --exclusive
gets only the CPUs it asks for, one per task without --cpus-per-task.

Sources: sbatch(1) --cpus-per-task and --exclusive; scontrol(1) `show node` (CPUEfctv,
Slurm >= 23.02: CPUTot less the CoreSpecCount/CPUSpecList cores Slurm keeps for itself;
Gres as gres.conf writes it, `gpu[:TYPE][:COUNT][(S:SOCKETS)]`) and `show partition`
(MaxCPUsPerNode, OverSubscribe=EXCLUSIVE: every job gets whole nodes).
"""
from __future__ import annotations

import os

import pytest

from enn_cluster.cluster.partition_shape import (
    NodeShape,
    Partition,
    cpus_per_task,
    gpu_count,
    parse_nodes,
    parse_partitions,
)
from helpers import cli, small_config, write_config

P5 = NodeShape("p5", 192, 8)  # AWS p5.48xlarge: 192 vCPUs, 8 x H100
DGX = NodeShape("dgx", 224, 8)  # DGX H100: 2 x 56 cores, 2 threads each
DEV = NodeShape("n1", 4, 8)  # slurm/dev/cluster.sh: CPUs=4, Gres=gpu:8


@pytest.mark.parametrize("nodes,gpus,tasks,max_cpus,whole,expected", [
    ([P5], 8, 8, None, False, 24),  # the whole node: its CPUs / its GPUs
    ([P5], 4, 4, None, False, 24),  # half the GPUs, half the CPUs
    ([P5], 1, 1, None, False, 24),
    ([DGX], 8, 8, None, False, 28),
    ([NodeShape("cs", 120, 8)], 8, 8, None, False, 15),  # CPUEfctv after CoreSpecCount=8
    ([DGX], 8, 8, 64, False, 8),  # MaxCPUsPerNode=64 on a shared GPU partition
    ([P5], 4, 4, None, True, 48),  # OverSubscribe=EXCLUSIVE: the whole node is the job's
    ([NodeShape("c", 128, 0)], 0, 4, None, False, 32),  # a CPU job: node CPUs / tasks
    ([P5, NodeShape("a", 64, 4), NodeShape("c", 32, 0)], 4, 4, None, False, 16),  # smallest fit
    ([P5, NodeShape("a", 64, 4), NodeShape("c", 32, 0)], 0, 2, None, False, 16),  # every node
    ([NodeShape("a", 64, 4)], 8, 8, None, False, None),  # no node has 8 GPUs
    ([NodeShape("c", 4, 0)], 0, 8, None, False, 1),  # more tasks than CPUs: at least 1
    ([DEV], 0, 2, None, False, 2),  # the dev cluster: 2 CPU tasks get 2 CPUs each
    ([DEV], 2, 2, None, False, 1),  # 2 of 8 GPUs: a quarter of 4 CPUs, over 2 tasks
    ([], 0, 1, None, False, None),
])
def test_cpus_per_task_from_the_node_shape(nodes, gpus, tasks, max_cpus, whole, expected):
    assert cpus_per_task(nodes, gpus, tasks, max_cpus, whole) == expected


@pytest.mark.parametrize("gres,gpus", [
    ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:2,nvme:1", 2), ("(null)", 0),
    ("gpu:tesla:2,gpu:kepler:2(S:0)", 4), ("gpu", 1), ("gpu:a100", 1), ("mps:400", 0), ("", 0),
])
def test_gpu_count_from_gres(gres, gpus):
    assert gpu_count(gres) == gpus


PARTITIONS = (
    "PartitionName=debug AllowGroups=ALL Default=YES MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] "
    "OverSubscribe=NO State=UP TotalCPUs=8 TotalNodes=2 TRES=cpu=8,mem=8000M,node=2\n"
    "PartitionName=gpu AllowGroups=ALL Default=NO MaxCPUsPerNode=96 Nodes=p5-[001-002] "
    "OverSubscribe=EXCLUSIVE State=UP TotalCPUs=384 TotalNodes=2\n"
    "PartitionName=empty Default=NO MaxCPUsPerNode=UNLIMITED Nodes=(null) State=UP\n")
NODES = (
    # Slurm 23.02+: CPUEfctv; the OS field holds spaces and '#'
    "NodeName=p5-001 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 CPUEfctv=184 CPUTot=192 "
    "CPULoad=0.12 AvailableFeatures=p5 Gres=gpu:h100:8(S:0-1) NodeAddr=10.0.0.5 "
    "OS=Linux 5.15.0-1051-aws #56-Ubuntu SMP x=1 RealMemory=2000000 CoreSpecCount=4 "
    "Partitions=gpu AllocTRES= CfgTRES=cpu=192,gres/gpu=8\n"
    # Slurm 22.05: CPUTot only
    "NodeName=p5-002 Arch=x86_64 CPUAlloc=0 CPUTot=192 CPULoad=0.00 Gres=gpu:8 "
    "Partitions=gpu\n")


def test_parse_scontrol_partitions_and_nodes():
    debug, gpu, empty = parse_partitions(PARTITIONS)
    assert debug == Partition("debug", "n[1-2]", True, None, False)
    assert gpu == Partition("gpu", "p5-[001-002]", False, 96, True)
    assert empty.nodes == "(null)"
    assert parse_nodes(NODES) == [NodeShape("p5-001", 184, 8), NodeShape("p5-002", 192, 8)]


def _stub_scontrol(tmp_path, partitions=PARTITIONS, nodes=NODES) -> tuple[dict, object]:
    """A scontrol first on PATH answering `-o --all show partition` and `-o show node NODES`
    with the text above, recording each call (no Slurm needed)."""
    bin_dir, asked = tmp_path / "bin", tmp_path / "scontrol-asked"
    bin_dir.mkdir()
    (tmp_path / "partitions.txt").write_text(partitions)
    (tmp_path / "nodes.txt").write_text(nodes)
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {asked}\ncase "$*" in\n'
                    f'  "-o --all show partition") cat {tmp_path}/partitions.txt ;;\n'
                    f'  "-o show node "*) cat {tmp_path}/nodes.txt ;;\n'
                    '  *) echo "scontrol: error: unexpected" >&2; exit 1 ;;\nesac\n')
    stub.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, asked


def _render(tmp_path, env, *flags):
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "cpus"))
    res = cli("render", cfg, "--container", "none", "--time", "10", "--nodes", "1", *flags,
              env=env)
    assert res.returncode == 0, res.stderr
    return res


def _cpus_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "--cpus-per-task" in line or "export SRUN_CPUS_PER_TASK" in line]


def test_render_sizes_cpus_per_task_from_the_partition_nodes(tmp_path):
    """No flag, no site value: the smallest node of the default partition (debug: the
    n[1-2] that scontrol answers for), its CPUs times the GPU share over the tasks; the
    rest of the job as it was (the site's interface among its variables)."""
    env, asked = _stub_scontrol(tmp_path, nodes=NODES.replace("p5-00", "n"))
    (tmp_path / "site.yaml").write_text("socket_ifname: ib0\n")
    env["ENN_SITE_CONFIG"] = str(tmp_path / "site.yaml")
    res = _render(tmp_path, env, "--gpus-per-node", "4")
    assert "export ENN_SOCKET_IFNAME=ib0" in res.stdout, res.stdout
    assert _cpus_lines(res.stdout) == [
        "#SBATCH --cpus-per-task=23",  # n1: CPUEfctv 184 x 4/8 GPUs / 4 tasks
        '[ -n "${SRUN_CPUS_PER_TASK+x}" ] || export SRUN_CPUS_PER_TASK=23'], res.stdout
    assert asked.read_text() == "-o --all show partition\n-o show node n[1-2]\n"
    assert "warning" not in res.stderr


def test_a_partition_of_whole_nodes_with_a_cpu_cap(tmp_path):
    env, asked = _stub_scontrol(tmp_path)
    res = _render(tmp_path, env, "--gpus-per-node", "4", "--partition", "gpu")
    assert "#SBATCH --cpus-per-task=24" in res.stdout  # min(184, 96) / 4 tasks (EXCLUSIVE)
    assert asked.read_text().splitlines()[-1] == "-o show node p5-[001-002]"


def test_a_job_naming_no_partition_is_sized_where_sbatch_sends_it(tmp_path):
    """sbatch sends a job that names no partition to SBATCH_PARTITION's, if set: the
    nodes sized are that partition's, not the default's."""
    env, asked = _stub_scontrol(tmp_path)
    res = _render(tmp_path, {**env, "SBATCH_PARTITION": "gpu"}, "--gpus-per-node", "4")
    assert "#SBATCH --cpus-per-task=24" in res.stdout
    assert asked.read_text().splitlines()[-1] == "-o show node p5-[001-002]"


@pytest.mark.parametrize("flags,site,expected", [
    (("--cpus-per-task", "6"), None, "6"),  # the CLI flag wins over the site and the nodes
    (("--cpus-per-task", "6"), "cpus_per_task: 10\n", "6"),
    ((), "cpus_per_task: 10\n", "10"),  # the site's default
])
def test_cli_flag_and_site_reach_the_rendered_job_without_asking_slurm(tmp_path, flags, site,
                                                                      expected):
    env, asked = _stub_scontrol(tmp_path)
    if site:
        (tmp_path / "site.yaml").write_text(site)
        env["ENN_SITE_CONFIG"] = str(tmp_path / "site.yaml")
    res = _render(tmp_path, env, "--gpus-per-node", "8", *flags)
    assert _cpus_lines(res.stdout) == [
        f"#SBATCH --cpus-per-task={expected}",
        f'[ -n "${{SRUN_CPUS_PER_TASK+x}}" ] || export SRUN_CPUS_PER_TASK={expected}']
    assert not asked.exists()


def fallback(tasks: int) -> str:
    return ('[ -n "${SRUN_CPUS_PER_TASK+x}" ] || export SRUN_CPUS_PER_TASK='
            f'$(( ${{SLURM_CPUS_ON_NODE:-{tasks}}} / {tasks} > 0 ? '
            f'${{SLURM_CPUS_ON_NODE:-{tasks}}} / {tasks} : 1 ))')


FALLBACK = fallback(8)


def test_exclusive_jobs_keep_the_allocation_fallback_without_asking(tmp_path):
    """--exclusive: the allocation is the whole node, SLURM_CPUS_ON_NODE / tasks is right."""
    env, asked = _stub_scontrol(tmp_path)
    res = _render(tmp_path, env, "--gpus-per-node", "4", "--exclusive")
    assert _cpus_lines(res.stdout) == [fallback(4)] and not asked.exists()
    assert "warning" not in res.stderr


@pytest.mark.parametrize("partition,why", [
    ("nope", "Slurm knows no partition 'nope' with nodes"),
    ("empty", "Slurm knows no partition 'empty' with nodes"),
])
def test_when_slurm_cannot_say_render_warns_that_submit_refuses(tmp_path, partition, why):
    """A GPU job on part of a node whose CPUs per task cannot be sized (issue 25 item 2):
    render prints the fallback and one warning line; submit refuses (below)."""
    env, _ = _stub_scontrol(tmp_path)
    res = _render(tmp_path, env, "--gpus-per-node", "4", "--partition", partition)
    assert _cpus_lines(res.stdout) == [fallback(4)]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("enn-submit: warning: submit refuses this job: --cpus-per-task: ")
    assert f"CPUs per task not sized from the nodes ({why})" in line, line
    assert "pass --cpus-per-task or set site.cpus_per_task" in line


def test_a_cpu_job_that_cannot_be_sized_keeps_the_fallback_with_a_warning(tmp_path):
    env, _ = _stub_scontrol(tmp_path)
    res = _render(tmp_path, env, "--procs-per-node", "2", "--partition", "nope")
    assert _cpus_lines(res.stdout) == [fallback(2)]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("enn-submit: warning: CPUs per task not sized from the nodes ("), line


def test_no_node_with_the_gpus_asked_for_keeps_the_fallback(tmp_path):
    env, _ = _stub_scontrol(tmp_path, nodes=NODES.replace("gpu:h100:8", "gpu:2").replace(
        "Gres=gpu:8", "Gres=gpu:2"))
    res = _render(tmp_path, env, "--gpus-per-node", "4")
    assert _cpus_lines(res.stdout) == [fallback(4)]
    assert "no node of partition debug has 4 GPUs" in res.stderr


def test_a_slurm_conf_that_names_no_file_is_not_asked(tmp_path):
    """scontrol retries a missing SLURM_CONF for 60 s before it gives up: not asked."""
    from enn_cluster.cluster.partition_shape import unreadable_config

    conf = tmp_path / "slurm.conf"
    assert unreadable_config({"SLURM_CONF": str(conf)}) == f"SLURM_CONF={conf} names no file"
    conf.write_text("ClusterName=x\n")
    assert unreadable_config({"SLURM_CONF": str(conf)}) is None
    assert unreadable_config({}) is None  # the clients' own default: asked


# -- whole-node requests (issue 25 item 2) ------------------------------------------------

def _sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_a_4x8_gpu_job_gets_whole_nodes_and_no_submitit_wckey(tmp_path):
    """Every GPU of each node: --exclusive and --mem=0 without asking Slurm, CPUs per task
    from the whole allocation; no --wckey=submitit (sites enforcing wckeys reject it)."""
    env, asked = _stub_scontrol(tmp_path)
    res = _render(tmp_path, env, "--gpus-per-node", "8", "--nodes", "4")
    lines = _sbatch_lines(res.stdout)
    assert "#SBATCH --exclusive" in lines and "#SBATCH --mem=0" in lines, lines
    assert "#SBATCH --nodes=4" in lines
    assert not [line for line in lines if "wckey" in line], lines
    assert _cpus_lines(res.stdout) == [FALLBACK] and not asked.exists()
    assert res.stderr == ""


@pytest.mark.parametrize("site,flags,expected", [
    ("whole_node_gpus: 0\n", (), ("#SBATCH --cpus-per-task=23",)),  # the rule off: sized
    ("whole_node_gpus: 4\n", ("--gpus-per-node", "4"), ("#SBATCH --exclusive", "#SBATCH --mem=0")),
    ("wckey: ml-prod\n", ("--mem-gb", "400"),  # a size given stays; the site's wckey
     ("#SBATCH --exclusive", "#SBATCH --mem=400GB", "#SBATCH --wckey=ml-prod")),
])
def test_site_keys_shape_the_whole_node_request(tmp_path, site, flags, expected):
    env, _ = _stub_scontrol(tmp_path)
    (tmp_path / "site.yaml").write_text(site)
    env["ENN_SITE_CONFIG"] = str(tmp_path / "site.yaml")
    res = _render(tmp_path, env, "--gpus-per-node", "8", *flags)
    lines = _sbatch_lines(res.stdout)
    assert set(expected) <= set(lines), lines
    if "whole_node_gpus: 0" in site:
        assert "#SBATCH --exclusive" not in lines and not any("--mem" in x for x in lines)


def test_site_wckey_is_checked(tmp_path):
    from enn_cluster.cluster.site import parse_site
    from enn_cluster.errors import UserError

    with pytest.raises(UserError, match=r"^site.wckey: 'a b' has characters"):
        parse_site({"wckey": "a b"})
    with pytest.raises(UserError, match=r"^site.whole_node_gpus: -1 must be >= 0"):
        parse_site({"whole_node_gpus": -1})


def test_submit_refuses_a_gpu_job_whose_cpus_cannot_be_sized(tmp_path):
    """Where render warns, `train --cluster slurm` stops in one line (exit 2) before sbatch
    and leaves no job and no run behind."""
    env, _ = _stub_scontrol(tmp_path)
    called = tmp_path / "sbatch-called"
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    sbatch.chmod(0o755)
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "refused"))
    res = cli("train", "--config", cfg, "--cluster", "slurm", "--container", "none",
              "--time", "10", "--nodes", "1", "--gpus-per-node", "4", "--partition", "nope",
              env=env)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("enn-submit: error: --cpus-per-task: CPUs per task not sized from the "
                           "nodes (Slurm knows no partition 'nope' with nodes)"), line
    assert not called.exists()
    assert not (tmp_path / "runs" / "refused").exists()  # nothing written


def test_site_allow_socket_fallback_reaches_every_task(tmp_path):
    env, _ = _stub_scontrol(tmp_path)
    (tmp_path / "site.yaml").write_text("allow_socket_fallback: true\n")
    env["ENN_SITE_CONFIG"] = str(tmp_path / "site.yaml")
    res = _render(tmp_path, env, "--gpus-per-node", "8", "--container", "/shared/enn.sqsh")
    assert "export ENN_ALLOW_SOCKET_FALLBACK=1" in res.stdout.splitlines()
    assert ",ENN_ALLOW_SOCKET_FALLBACK" in res.stdout  # --container-env: over the image's
    (tmp_path / "site.yaml").write_text("allow_socket_fallback: false\n")
    assert "ENN_ALLOW_SOCKET_FALLBACK" not in _render(tmp_path, env, "--gpus-per-node", "8").stdout
