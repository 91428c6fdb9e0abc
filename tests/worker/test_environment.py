"""Rank/world/master discovery from Slurm, torchrun and the local launcher (pure)."""
import pytest

from enn_cluster.worker.environment import (clean_environment, discover, expand_hostlist,
                                     expand_tasks_per_node, port_for_job)
from enn_cluster.errors import UserError


def test_hostlist_expansion():
    assert expand_hostlist("n[1-3,07],gpu-a1") == ["n1", "n2", "n3", "n07", "gpu-a1"]
    assert expand_hostlist("node[001-002]") == ["node001", "node002"]
    assert expand_hostlist("single") == ["single"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_slurm_discovery_and_cleaning():
    environ = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
               "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "gpu[10-13]",
               "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "4242",
               "SLURM_RESTART_COUNT": "1", "RANK": "99", "WORLD_SIZE": "1",
               "TORCHELASTIC_RUN_ID": "stale"}
    environ.pop("TORCHELASTIC_RUN_ID")  # torchrun inside Slurm would take precedence
    env = discover(environ)
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("slurm", 5, 1, 8)
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (2, 4, 2)
    assert env.master_addr == "gpu10" and env.master_port == port_for_job("4242")
    assert env.restart_count == 1
    clean = clean_environment(environ, env, cpus=(16, 16))
    assert clean["RANK"] == "5" and clean["WORLD_SIZE"] == "8" and clean["MASTER_ADDR"] == "gpu10"
    assert clean["OMP_NUM_THREADS"] == "8"  # 16 unbound CPUs shared by 2 tasks on the node
    bound = clean_environment({**environ, "SLURM_CPUS_PER_TASK": "12"}, env, cpus=(12, 96))
    assert bound["OMP_NUM_THREADS"] == "12"


def test_a_cyclic_task_layout_is_refused_naming_the_srun_flag():
    """SLURM_DISTRIBUTION=cyclic (a site default) puts rank 1 on node 1: each node's shard
    group would span nodes. The worker refuses (exit 2) before any lane opens; the block
    layout of the same step passes."""
    cyclic = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
              "SLURM_JOB_ID": "7", "SLURM_DISTRIBUTION": "cyclic"}
    with pytest.raises(UserError, match=r"^SLURM_DISTRIBUTION: rank 1 is task 0 of node 1, "
                       r"where a block layout puts rank 2: .*\(cyclic\).*"
                       r"srun --distribution=block"):
        discover(cyclic)
    block = discover({**cyclic, "SLURM_PROCID": "2", "SLURM_DISTRIBUTION": "block"})
    assert (block.rank, block.node_rank, block.local_rank) == (2, 1, 0)
    uneven = {**cyclic, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "3"}
    assert discover(uneven).local_world_size == 1


def test_torchrun_and_local_discovery():
    tr = discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
                   "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (tr.launcher, tr.node_rank, tr.num_nodes, tr.restart_count) == ("torchrun", 1, 2, 2)
    loc = discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                    "ENN_SIM_NODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert (loc.launcher, loc.node_rank, loc.local_rank, loc.local_world_size) == ("local", 1, 1, 2)
    with pytest.raises(UserError, match="ENN_SIM_NODES"):
        discover({"RANK": "0", "WORLD_SIZE": "3", "ENN_SIM_NODES": "2"})
    assert discover({}).launcher == "single"
