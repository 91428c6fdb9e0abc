"""Pieces of the training loop that need no process group."""
from __future__ import annotations

import gc

import pytest
import torch

from enn_cluster.worker.step_math import StepNorm, scheduled_gc


def test_scheduled_gc_freezes_then_restores():
    assert gc.isenabled()
    with scheduled_gc():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with scheduled_gc():
            raise RuntimeError("training failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _norm_and_clip(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    step_norm = StepNorm(params, torch.device("cpu"), world_size=1)
    norm, loss_sum = step_norm.reduce(step_norm.shard_norms(),
                                      torch.tensor(2.5, dtype=torch.float64), max_norm)
    assert float(loss_sum) == 2.5  # the loss rides in the same all-reduce
    return float(norm)


def test_step_norm_matches_torchs_clip(world_of_one):
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(16, 8) * 10
    for m in (ours, theirs):
        m(x).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0))
    assert _norm_and_clip(ours, 1.0) == pytest.approx(expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(a.grad, b.grad)
    before = [p.grad.clone() for p in ours.parameters()]
    norm = _norm_and_clip(ours, float("inf"))  # no clipping, norm only
    assert norm == pytest.approx(1.0, rel=1e-4)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters()))


def test_nonfinite_watch_flags_exactly_the_gradients_holding_nan_or_inf():
    """One flag per parameter: set where its gradient holds a NaN or an Inf anywhere (a
    single element is enough), clear where it is finite or absent."""
    from enn_cluster.worker.nonfinite import NonFiniteWatch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2),
                                torch.nn.Linear(2, 1))
    watch = NonFiniteWatch(model, torch.device("cpu"), replicate=1, history=1)
    norms = StepNorm(watch.params, torch.device("cpu"), world_size=1)
    model(torch.randn(4, 64)).sum().backward()
    assert watch.flags(norms.shard_norms()).tolist() == [0] * 6
    params = list(model.parameters())
    params[0].grad[17, 40] = float("nan")
    params[3].grad[1] = float("-inf")
    params[4].grad = None  # a parameter no loss reached
    params[5].grad[0] = 3e38  # finite, large: not flagged
    assert watch.flags(norms.shard_norms()).tolist() == [1, 0, 0, 1, 0, 0]


def test_step_norm_clips_fsdp2_gradients(world_of_one):
    """On DTensor gradients (FSDP2 on a 2-D mesh) the norm comes from the local shards and
    the clip scales them (4 processes: tests/worker/test_step_norm.py)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(32, 8) * 10
    for m in (ref, model):
        m(x).pow(2).sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    assert expected > 0.5
    assert _norm_and_clip(model, 0.5) == pytest.approx(expected, rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a.grad.full_tensor(), b.grad, rtol=1e-5, atol=1e-7)


SYNC_COUNTER = r"""
import inspect, json, os, sys
import torch
from enn_cluster.worker import trainer as tr
from enn_cluster.worker.entry import run_task

conversions = []
def counting(name):
    original = getattr(torch.Tensor, name)
    def wrapper(self, *a, **k):
        caller = inspect.currentframe().f_back.f_code.co_filename
        if not caller.endswith("lanes.py"):  # the control lane's host tensors are no sync
            conversions.append(f"{name} {os.path.basename(caller)}")
        return original(self, *a, **k)
    setattr(torch.Tensor, name, wrapper)
for name in ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"):
    counting(name)

# A tensor made from host numbers on the device is a host-to-device copy that the host
# waits for (pageable memory): torch.tensor(x, device=...) in a step is counted too.
original_tensor = torch.tensor
def tensor(*a, **k):
    if k.get("device") is not None:
        caller = inspect.currentframe().f_back.f_code.co_filename
        conversions.append(f"tensor(device=) {os.path.basename(caller)}")
    return original_tensor(*a, **k)
torch.tensor = tensor

# A step's window runs from its train_step to the next one's: the loop's own body counts.
starts, log_steps = [], []
original_step = tr.Trainer.train_step
def train_step(self, perm, flags=(), log_step=True):
    starts.append(len(conversions))
    log_steps.append(log_step)
    return original_step(self, perm, flags, log_step)
tr.Trainer.train_step = train_step
original_save = tr.Trainer.save
def save(self, async_save):  # a checkpoint's copies to the host are the save's, not the step's
    before = len(conversions)
    original_save(self, async_save)
    del conversions[before:]
tr.Trainer.save = save
code = run_task(sys.argv[1])
ends = starts[1:] + [len(conversions)]
per_step = [(log, conversions[a:b]) for log, a, b in zip(log_steps, starts, ends)]
print(json.dumps({"code": code, "per_step": per_step}), flush=True)
os._exit(0)  # as the worker leaves (worker.exit_now): no finalisation race with gloo threads
"""


def test_no_device_to_host_read_in_steps_that_do_not_log(tmp_path):
    """Loss, gradient norm and the non-finite decision stay on the device between log
    steps: a step that does not log converts no tensor to a Python value or a host copy,
    and makes no device tensor from host numbers (issue 25: the non-finite watch's step
    and lr did, twice a step), neither in train_step nor in the loop around it
    (checkpoint saves aside). Log steps: every logging.every_steps, each checkpoint
    (checkpoint.every_steps 8 here) and the last."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT, cli, small_config, write_config

    # no eval rows: an evaluation reads its loss back by design, as a checkpoint does, and a
    # run ends with one (training.eval_every_steps); this counts the steps' own reads
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "sync", training={"max_steps": 10}, logging={"every_steps": 5},
        data={"eval_fraction": 0.0}, parallel={"nodes": 1, "procs_per_node": 1}))
    assert cli("prepare", "--config", cfg).returncode == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_PORT=str(_free_port()))
    res = subprocess.run([sys.executable, "-c", SYNC_COUNTER, str(tmp_path / "runs" / "sync")],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and len(out["per_step"]) == 10
    quiet = [len(c) for log_step, c in out["per_step"] if not log_step]
    loud = [step for step, (log_step, c) in enumerate(out["per_step"], 1) if log_step]
    assert quiet == [0] * 7, out["per_step"]
    assert loud == [5, 8, 10], out["per_step"]
    assert all(0 < len(out["per_step"][s - 1][1]) <= 4 for s in loud), out["per_step"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- cadence and GPU defaults (issue 25 items 3 and 5) ------------------------------------

def test_cadence_reads_at_log_steps_checkpoints_and_the_end():
    from enn_cluster.worker.step_math import Cadence

    c = Cadence(log_every=10, every_steps=25, every_minutes=0)
    reads = [s for s in range(1, 56) if c.log_step(s, total_steps=55)]
    assert reads == [10, 20, 25, 30, 40, 50, 55]
    assert [s for s in range(1, 56) if c.step_due(s)] == [25, 50]
    assert Cadence(log_every=1).log_step(3, 9) and not Cadence(log_every=4).step_due(4)


def test_cadence_votes_for_a_time_based_save_once_the_minutes_have_passed():
    """checkpoint.every_minutes: a test's clock, no sleeping."""
    from enn_cluster.worker.step_math import Cadence

    now = [1000.0]
    c = Cadence(log_every=10, every_minutes=30, clock=lambda: now[0])
    assert c.time_due() == 0
    now[0] += 30 * 60 - 1
    assert c.time_due() == 0
    now[0] += 1
    assert c.time_due() == 1
    c.saved()  # any save restarts the count
    assert c.time_due() == 0
    now[0] += 10**6
    assert Cadence(log_every=1, every_minutes=0, clock=lambda: now[0]).time_due() == 0


def test_defaults_differ_on_gpu_and_cpu_and_explicit_values_win():
    from enn_cluster.config.run_config import CheckpointConfig, LoggingConfig

    log_cfg, ckpt_cfg = LoggingConfig(), CheckpointConfig()
    assert (log_cfg.steps_on("cuda"), log_cfg.steps_on("cpu")) == (10, 1)
    assert LoggingConfig(every_steps=3).steps_on("cuda") == 3
    assert (ckpt_cfg.async_on("cuda"), ckpt_cfg.async_on("cpu")) == (True, False)
    assert CheckpointConfig(async_save="false").async_on("cuda") is False
    assert CheckpointConfig(async_save="true").async_on("cpu") is True
    assert (ckpt_cfg.threads_on("cuda"), ckpt_cfg.threads_on("cpu")) == (4, 1)
    assert CheckpointConfig(writer_threads=8).threads_on("cpu") == 8
    assert ckpt_cfg.every_minutes == 30


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.every_minutes=-1"], "checkpoint.every_minutes: -1.0 must be >= 0"),
    (["checkpoint.writer_threads=17"], "checkpoint.writer_threads: 17 must be 0 (auto) to 16"),
    (["checkpoint.async_save=sometimes"], "checkpoint.async_save"),
    (["logging.every_steps=-2"], "logging.every_steps: -2 must be >= 0"),
    (["training.lr_schedule=step"], "training.lr_schedule"),
    (["training.min_lr_ratio=1.5"], "training.min_lr_ratio: 1.5 must be in"),
    (["training.adam_beta2=1"], "training.adam_beta2: 1.0 must be in"),
    (["training.adam_eps=0"], "training.adam_eps: 0.0 must be in (0, 1]"),
    (["training.eval_every_steps=-1"], "training.eval_every_steps: -1 must be >= 0"),
])
def test_bad_cadence_settings_name_the_key(tmp_path, overrides, message):
    from enn_cluster.config.loading import load_config
    from enn_cluster.errors import UserError
    from helpers import small_config, write_config

    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(str(cfg), overrides)


def test_a_boolean_async_save_still_loads(tmp_path):
    """Run directories written before `auto` hold async_save: true/false."""
    from enn_cluster.config.loading import load_config
    from helpers import small_config, write_config

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, checkpoint={"async_save": True}))
    assert load_config(str(cfg)).checkpoint.async_save == "true"


def test_a_save_longer_than_the_stop_grace_is_named():
    from enn_cluster.storage.commits import save_over_grace

    assert save_over_grace(100, 59.0, 60.0) is None
    line = save_over_grace(100, 140.2, 60.0)
    assert line.startswith("checkpoint step-100 took 140 s, longer than the stop grace (60 s)")
    assert "parallel.stop_grace_s" in line and "--signal-grace 241 " in line
    assert "async saves" in line


def test_the_grace_a_save_needs():
    from enn_cluster.storage.commits import grace_for_save

    assert grace_for_save(50.0, 90) == 90  # fits with 30 s to spare
    assert grace_for_save(70.0, 90) == 135  # 1.5 x 70 + 30
    assert grace_for_save(400.0, 90) == 630
    assert grace_for_save(400.0, 90, limit_s=300) == 300  # the time limit caps it
    assert grace_for_save(400.0, 90, limit_s=60) == 90  # never below what was asked


def test_time_based_checkpoints_are_agreed_and_carry_their_metrics(tmp_path):
    """checkpoint.every_minutes alone (no every_steps), tiny (60 us): the first step is
    due (setting up takes longer), and a step is due again once 60 us have passed since a
    save; both ranks agree on each one, and each checkpoint's step, and only those, has
    its `train` record (logging.every_steps=100 reads no step by itself)."""
    from helpers import cli, metrics, small_config, write_config

    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "timed", training={"max_steps": 4},
        checkpoint={"every_steps": 0, "every_minutes": 1e-6, "keep_last": 10},
        logging={"every_steps": 100}, parallel={"nodes": 1, "procs_per_node": 2}))
    res = cli("train", "--config", cfg)
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "runs" / "timed"
    saved = [r["step"] for r in metrics(run, "checkpoint")]
    assert saved[0] == 1 and saved[-1] == 4 and len(saved) >= 2, saved
    assert [r["step"] for r in metrics(run, "train")] == saved
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"step-{s}" for s in saved]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedules_after_warmup_are_torch_s_own(schedule):
    """lr_at against torch.optim.lr_scheduler over the same steps: CosineAnnealingLR to
    eta_min, LinearLR to end_factor, ConstantLR with factor 1 (no warmup; warmup is the
    documented (s + 1) / W ramp, checked after)."""
    import torch

    from enn_cluster.config.schedule import lr_at

    total, lr, floor = 37, 3e-3, 0.2
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = {"cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(
                 opt, T_max=total, eta_min=floor * lr),
             "linear": lambda: torch.optim.lr_scheduler.LinearLR(
                 opt, start_factor=1.0, end_factor=floor, total_iters=total),
             "constant": lambda: torch.optim.lr_scheduler.ConstantLR(
                 opt, factor=1.0, total_iters=total)}[schedule]()
    theirs = []
    for _ in range(total + 1):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr_at(s, total, lr, 0.0, floor, schedule) for s in range(total + 1)]
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-15)
    warm = [lr_at(s, 100, lr, 0.1, floor, schedule) for s in range(11)]
    assert warm[:10] == pytest.approx([lr * (s + 1) / 10 for s in range(10)])
    assert warm[10] == pytest.approx(lr)  # the decay starts from lr


def test_a_resume_takes_the_config_s_optimizer_settings_not_the_checkpoint_s():
    """A loaded AdamW state brings the betas, eps and weight decay it was saved with;
    apply_hyperparameters gives the run's config the last word (and the fused kernel)."""
    import torch

    from enn_cluster.config.run_config import TrainingConfig
    from enn_cluster.worker.step_math import apply_hyperparameters, new_optimizer

    param = torch.nn.Parameter(torch.ones(3))
    old = new_optimizer([param], TrainingConfig(adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1))
    param.grad = torch.ones(3)
    old.step()
    t = TrainingConfig(adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-7, weight_decay=0.0)
    new = new_optimizer([param], t)
    new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["betas"] == (0.9, 0.95)  # the checkpoint's, as loaded
    apply_hyperparameters(new, t)
    group = new.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["fused"]) == \
        ((0.8, 0.99), 1e-7, 0.0, True)
    assert int(new.state[param]["step"]) == 1  # the moments and step count are kept
