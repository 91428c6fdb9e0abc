"""Each benchmark's own path, small: the GPU benchmark on the CPU with a tiny model, the
checkpoint, control-plane and text-staging benchmarks end to end in quick mode, and the pure
parts of the scale, collect and metadata benchmarks. Nothing is timed; the figures come only
from `make bench`. The harness around them: test_bench_harness.py."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import report, run  # noqa: E402


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="with CUDA main would run the ~1B-parameter benchmark; "
                    "test_gpu_bench_measures_a_tiny_decoder_on_cuda runs the GPU path")
def test_main_runs_the_gpu_entry_end_to_end(tmp_path, capsys):
    """Without CUDA the gpu entry runs through main and reports a skip, not a failure."""
    assert run.main(["--only", "gpu", "--out", str(tmp_path / "out"),
                     "--workdir", str(tmp_path / "work")]) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["bench"] for r in doc["results"]] == ["gpu"]
    assert doc["results"][0]["skipped"].startswith("skipped:")
    assert not (tmp_path / "work").exists()  # scratch removed without --keep


def test_scale_results_from_fake_timelines():
    from bench import scale

    def timeline(world, ttfs, resume=False):
        out = {"ttfs": ttfs, "launch": 0.5, "ranks_up": ttfs / 2, "setup": ttfs / 3,
               "step1": 0.1, "step_time": 0.01 * world,
               "stamps": [100.0 + i * 0.02 * world for i in range(20)], "save": 0.1 * world}
        if resume:
            out["resume"] = {"step": 20, "from_world": 32, "world_size": 16}
        return out

    ours = {w: [timeline(w, 2.0 * w)] for w in scale.WORLDS}
    bare = {w: [timeline(w, 1.5 * w)] for w in scale.WORLDS}
    resumed = [timeline(16, 40.0, resume=True)]
    s = {"hidden": [64, 64], "features": 16, "batch": 8, "steps": 20, "skip": 5}
    results = scale._results(s, ours, bare, resumed)
    by_name = {r.name: r for r in results}
    assert by_name["scale: time to first step growth, 4 -> 32 ranks"].samples == [8.0]
    assert by_name["scale: time to first step, 32 ranks, vs bare FSDP2"].samples == \
        [pytest.approx(4 / 3)]
    assert "from world 32 to 16" in by_name[
        "scale: resume 32 -> 16 ranks, time to first step vs a fresh 16-rank start"].note
    assert all(r.verdict == "info" for r in results)
    assert "| scale: checkpoint save, 32 vs 4 ranks |" in report.table(results)


def test_collect_baseline_concatenates_chunk_data(tmp_path):
    from bench.collect import raw_concatenate

    parts = [np.arange(i * 12, (i + 1) * 12, dtype=np.float32).reshape(4, 3) for i in range(3)]
    files = []
    for i, part in enumerate(parts):
        files.append(tmp_path / f"chunk-{i}.npy")
        np.save(files[-1], part)
    out = tmp_path / "all.npy"
    raw_concatenate(files, out, (12, 3), "<f4")
    np.testing.assert_array_equal(np.load(out), np.concatenate(parts))


def test_gpu_bench_counts_parameters_and_skips_without_cuda(tmp_path):
    """bench/gpu.py's FLOP formula counts the parameters of the Llama that transformers
    builds from the same shape (on the meta device), and without CUDA run() reports a skip."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import gpu
    from bench.measure import BenchContext

    for shape in (gpu.TINY, gpu.Shape()):
        config = AutoConfig.for_model("llama", vocab_size=512, **shape.hf())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counted = sum(p.numel() for n, p in model.named_parameters()
                      if not n.startswith(("model.embed_tokens.", "lm_head.")))
        assert counted == shape.params()
    assert 0.9e9 < gpu.Shape().params() < 1.1e9  # the ~1B of the benchmark's name
    t = gpu.TINY
    assert t.flops_per_token() == 6 * t.params() + 12 * t.layers * t.hidden * t.seq
    if not torch.cuda.is_available():
        ctx = BenchContext(quick=True, workdir=tmp_path, root=tmp_path, python=sys.executable,
                           repeats=1)
        (result,) = gpu.run(ctx)
        assert result.skipped.startswith("skipped: no CUDA") and result.verdict == "not measured"


def test_gpu_bench_path_trains_the_product_on_the_cpu(tmp_path):
    """The path the GPU figure takes, run on the CPU with the tiny Llama (gpus 0: 2 CPU
    processes): `enn-submit train` on an hf: weights directory, tokens/s from its
    metrics.jsonl. On CUDA only the process count, --gpus-per-node and bf16 change."""
    from bench import gpu
    from bench.measure import BenchContext

    ctx = BenchContext(quick=True, workdir=tmp_path, root=ROOT, python=sys.executable,
                       repeats=1)
    (rate,) = gpu.measure(ctx, gpu.TINY, gpus=0, steps=3, repeats=1)
    assert rate > 0
    records = [json.loads(line) for line in
               (tmp_path / "gpu" / "runs" / "gpu-0" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 3 + gpu.WARMUP + 1))
    start = next(r for r in records if r["kind"] == "start")
    assert start["world_size"] == 2 and start["global_batch"] == 2 * gpu.TINY.batch


@pytest.mark.parametrize("device_name,peak", [
    # torch.cuda.get_device_name as each board reports itself; dense bf16 from the data
    # sheets (half the "with sparsity" figure): H100 SXM 989, PCIe 756, NVL 835; H200 989,
    # H200 NVL 835; GH200 is an H200 (989); A100 312 in every form factor
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", None),  # not in the table: MFU unknown, not a failure
    ("Tesla V100-SXM2-32GB", None),
])
def test_gpu_peak_from_the_device_name(device_name, peak):
    from bench import gpu

    assert gpu.peak_tflops(device_name, environ={}) == peak
    assert gpu.peak_tflops(device_name, environ={"ENN_GPU_PEAK_TFLOPS": "123.5"}) == 123.5


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_gpu_bench_measures_a_tiny_decoder_on_cuda(tmp_path):
    """On a GPU machine: the benchmark's own path (FSDP2/HSDP over every GPU, NCCL) on a
    decoder small enough for a test; MFU is reported when the GPU's peak is known."""
    import torch

    from bench import gpu
    from bench.measure import BenchContext

    ctx = BenchContext(quick=True, workdir=tmp_path, root=tmp_path, python=sys.executable,
                       repeats=1)
    (result,) = gpu.run(ctx, gpu.TINY)
    assert not result.skipped and result.verdict == "info"
    assert len(result.ours.values) == 1 and result.ours.values[0] > 0
    if gpu.peak_tflops(torch.cuda.get_device_name(0)) is None:
        assert result.samples == [] and "MFU unknown" in result.note
    else:
        assert len(result.samples) == 1 and 0 < result.samples[0] < 1


def test_metadata_ops_are_counted_between_the_markers():
    """The strace window parser: only calls between the markers, only paths under the
    checkpoint root (fd-only calls all), directory listings of the root found."""
    from bench.metadata_ops import MARK, count_window

    root = "/ck"
    trace = "\n".join([
        f'10 1.0 openat(AT_FDCWD, "{root}/step-1/a", O_WRONLY|O_CREAT, 0640) = 3',  # before
        f'10 2.0 newfstatat(AT_FDCWD, "{root}/{MARK}-begin-0", 0x7f, 0) = -1 ENOENT',
        f'11 2.5 newfstatat(AT_FDCWD, "{root}/{MARK}-begin-1", 0x7f, 0) = -1 ENOENT',
        f'10 3.0 openat(AT_FDCWD, "{root}/step-2/__0_0.distcp", O_WRONLY|O_CREAT, 0640) = 3',
        '12 3.1 fsync(3) = 0',
        f'10 3.2 renameat2(AT_FDCWD, "{root}/step-2/.tmp", AT_FDCWD, "{root}/step-2/x", 0) = 0',
        '10 3.3 openat(AT_FDCWD, "/usr/lib/python3/x.py", O_RDONLY) = 4',  # not under root
        f'11 3.4 openat(AT_FDCWD, "{root}", O_RDONLY|O_NONBLOCK|O_CLOEXEC|O_DIRECTORY) = 5',
        '11 3.5 getdents64(5, 0x55 /* 4 entries */, 32768) = 112',
        f'10 3.6 openat(AT_FDCWD, "{root}/step-2", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 6',
        f'10 4.0 newfstatat(AT_FDCWD, "{root}/{MARK}-end-0", 0x7f, 0) = -1 ENOENT',
        f'11 4.5 newfstatat(AT_FDCWD, "{root}/{MARK}-end-1", 0x7f, 0) = -1 ENOENT',
        '12 5.0 fsync(3) = 0',  # after
    ])
    found = count_window(trace, root)
    assert found == {"counts": {"open": 3, "fsync": 1, "rename": 1, "listdir": 1},
                     "dir_listings": 2, "listers": 2}
    with pytest.raises(RuntimeError, match="no markers"):
        count_window("10 1.0 fsync(3) = 0", root)


def test_a_signal_that_ended_the_traced_save_is_named_with_its_sender(tmp_path):
    """A real strace of a shell that its own kill stops: the line names receiver, signal
    and sender; a signal strace itself forwards is said to come from outside."""
    import shutil
    import subprocess

    from bench.metadata_ops import signals_sent

    if shutil.which("strace") is None:
        pytest.skip("strace not installed")
    trace = tmp_path / "trace.txt"
    proc = subprocess.run(["strace", "-f", "-ttt", "-qq", "-e", "trace=openat", "-o", str(trace),
                           "sh", "-c", "kill -TERM $$"], capture_output=True)
    assert proc.returncode != 0
    (line,) = signals_sent(trace.read_text(), tracer_pid=-1)
    pid = line.split()[1]
    assert line.startswith(f"pid {pid} got SIGTERM from pid {pid} (")
    forwarded = "77 1.5 --- SIGTERM {si_signo=SIGTERM, si_code=SI_USER, si_pid=12, si_uid=0} ---"
    assert signals_sent(forwarded, tracer_pid=12) == [
        "pid 77 got SIGTERM from pid 12 (strace, signalled from outside)"]
    assert signals_sent("77 1.5 --- SIGCHLD {si_signo=SIGCHLD, si_code=CLD_EXITED, si_pid=9}"
                        " ---", tracer_pid=12) == []


def test_the_control_plane_simulation_commits_a_step_with_the_products_functions(tmp_path):
    """The simulated coordinator (fake process group, 8 ranks) plans with DCP, writes a
    real `.metadata` and commit record that the product's committed check accepts."""
    from bench.control_plane import _one
    from bench.measure import BenchContext

    ctx = BenchContext(quick=True, workdir=tmp_path, root=ROOT, python=sys.executable, repeats=1)
    found = _one(ctx, 8)
    assert found["world"] == 8 and found["ours_s"] >= found["plan_s"] > 0
    record = json.loads((tmp_path / "control-8" / "ours" / "step-10" / "commit.json").read_text())
    assert sorted(record["files"]) == sorted(
        [".metadata"] + [f"__{r}_0.distcp" for r in range(8)] + [f"rng/rank-{r}.pt" for r in range(8)])
    assert found["commit_bytes"] > 0 and found["metadata_bytes"] > found["plan_bytes"] > 0


def test_the_text_staging_benchmark_runs_on_a_model_directory(tmp_path):
    """Quick mode of bench/text_staging.py end to end (20,000 documents, one repeat): its
    config names a directory model.name accepts (config.json beside the tokenizer); the
    full run once reported this figure as failed when that check tightened."""
    from bench import text_staging
    from bench.measure import BenchContext

    ctx = BenchContext(quick=True, workdir=tmp_path, root=ROOT, python=sys.executable, repeats=1)
    [result] = text_staging.run(ctx)
    assert not result.skipped and len(result.samples) == 1 and result.samples[0] > 0


def test_checkpoint_bench_times_every_side_of_every_repeat(tmp_path):
    """The checkpoint benchmark end to end in quick mode (2 ranks, a 1024-wide MLP): save,
    load and resume each timed against the raw side in every repeat, the sides' files
    evicted after each (the page cache each side starts from is the same), the bytes a
    2x2 HSDP resume reads counted, and the scratch folders gone afterwards; the bench's own
    environment as it was (the next benchmark's jobs inherit it)."""
    from bench import checkpoint
    from bench.measure import BenchContext

    ctx = BenchContext(quick=True, workdir=tmp_path, root=ROOT, python=sys.executable,
                       repeats=3)
    before = dict(os.environ)
    results = checkpoint.run(ctx, ["checkpoint"])
    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    names = [r.name for r in results]
    assert names == ["checkpoint save throughput vs raw write",
                     "checkpoint load throughput vs raw read",
                     "resume read (verify while loading) vs raw read",
                     "resume bytes read from the filesystem per byte of shards, 2x2 HSDP"], names
    for r in results[:3]:
        assert len(r.samples) == 3 and all(s > 0 for s in r.samples), (r.name, r.samples)
        assert len(r.ours.values) == len(r.baseline.values) == 3
    [replicas] = results[3].samples  # a count: one copy, where each replica reading is 2x
    assert 1.0 <= replicas <= 1.05 and results[3].verdict == "pass", results[3]
    assert results[0].floor == 0.8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert not any((tmp_path / "runs").iterdir())
