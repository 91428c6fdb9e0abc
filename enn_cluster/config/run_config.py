"""Run config schema: the typed section dataclasses, their checks, and the mesh plan.

The dataclasses are the list of settings (docs.py renders config.md from them); loading.py
builds them from YAML and `--set` overrides. Everything a worker needs is in the resolved
config frozen into the run directory, so every task of a job (and every restart) reads the
same thing. Validation errors are `UserError`s that name the key and the fix; nothing here
imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from enn_cluster.config.checks import (
    MAX_BATCH_ROWS,
    MAX_COUNT,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_NODES,
    MAX_PROCS_PER_NODE,
    MAX_WIDTH,
    _bounded,
    _choice,
    _no_secret_keys,
    _non_negative,
    _path_text,
    _positive,
    _seed,
    check_home,
    check_metrics_path,
    no_credentials_in_url,
)
from enn_cluster.config.lm_config import HF_PREFIX, LM_TASK, LoraConfig, is_hf_model, takes_lora
from enn_cluster.errors import UserError

MAX_SYNTHETIC_VALUES = 2**30  # float32 values generated in memory (4 GiB)
MAX_WAIT_S = 7 * 24 * 3600.0  # timeouts beyond a week overflow gloo/alarm and mean a typo
MAX_WRITER_THREADS = 16  # DCP writes one file per thread and rank
MAX_STRIPE_COUNT = 2000  # Lustre's own limit on a file's stripes
# parallel.activation_checkpointing, least memory saved first (worker/parallel.py applies them)
CHECKPOINTING_MODES = ("none", "selective", "every_other", "full")
GPU_LOG_EVERY_STEPS = 10  # logging.every_steps 0 on GPU (torchtitan's log_freq)
GPU_WRITER_THREADS = 4
MAX_NAME_BYTES = 200  # run_name: a path component, with room for '.NAME.creating-PID'


@dataclass
class ModelConfig:
    name: str = "mlp"  # mlp | transformer | "package.module:factory" | "hf:/weights/dir"
    task: str = "regression"  # regression | classification | causal_lm (hf: models)
    hidden_sizes: list = field(default_factory=lambda: [64, 64])
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    kwargs: dict = field(default_factory=dict)  # passed to a user factory

    def validate(self) -> None:
        _bounded("model.d_model", self.d_model, MAX_WIDTH)
        _bounded("model.n_layers", self.n_layers, MAX_LAYERS)
        _bounded("model.n_heads", self.n_heads, MAX_WIDTH)
        if is_hf_model(self.name):
            if not self.name[len(HF_PREFIX):].strip():
                raise UserError("model.name: 'hf:' names no model; give hf:/path/to/weights "
                                "(a directory with config.json) or a name in the local HF cache")
            if self.task == "regression":  # the default: an LM's task is implied by hf:
                self.task = LM_TASK
            if self.task != LM_TASK:
                raise UserError(f"model.task: {self.task!r} does not fit a Hugging Face model "
                                f"({self.name}); use {LM_TASK} or leave it out")
        elif self.task == LM_TASK:
            raise UserError(f"model.task: {LM_TASK} needs a Hugging Face model; set "
                            "model.name: hf:/path/to/weights")
        _choice("model.task", self.task, ("regression", "classification", LM_TASK))
        if self.name not in ("mlp", "transformer") and ":" not in self.name:
            raise UserError(f"model.name: {self.name!r} is not a built-in model; "
                            "use mlp, transformer, 'package.module:factory' or hf:/weights/dir")
        if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in self.hidden_sizes):
            raise UserError("model.hidden_sizes: must be a list of positive integers, e.g. [64, 64]")
        if len(self.hidden_sizes) > MAX_LAYERS or any(h > MAX_WIDTH for h in self.hidden_sizes):
            raise UserError(f"model.hidden_sizes: a layer wider than {MAX_WIDTH} units, or more "
                            f"than {MAX_LAYERS} layers, cannot be built; give real sizes")
        if self.d_model % self.n_heads:
            raise UserError(f"model.d_model: {self.d_model} is not divisible by model.n_heads "
                            f"{self.n_heads}; pick sizes that divide")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError("model.dropout: must be in [0, 1)")
        _no_secret_keys("model.kwargs", self.kwargs)


MAX_TEXT_LENGTH = 1 << 20  # tokens per row


@dataclass
class SyntheticConfig:
    n_samples: int = 2048
    n_features: int = 16
    n_outputs: int = 1
    noise: float = 0.05
    seed: int = 1234

    def validate(self) -> None:
        _positive("data.synthetic.n_samples", self.n_samples)
        _positive("data.synthetic.n_features", self.n_features)
        _positive("data.synthetic.n_outputs", self.n_outputs)
        if self.noise < 0:
            raise UserError("data.synthetic.noise: must be >= 0")
        _seed("data.synthetic.seed", self.seed)
        values = self.n_samples * (self.n_features + self.n_outputs + 32)
        if values > MAX_SYNTHETIC_VALUES:
            raise UserError(f"data.synthetic: n_samples x (n_features + n_outputs + 32) = "
                            f"{values} values is more than synthetic data supports "
                            f"({MAX_SYNTHETIC_VALUES}); make it smaller or give data.train_path")


@dataclass
class DataConfig:
    train_path: str = "synthetic"  # .npy/.npz path or fsspec URL, or "synthetic"
    train_targets_path: Optional[str] = None  # .npy of targets when train_path is an .npy
    eval_path: Optional[str] = None
    eval_targets_path: Optional[str] = None
    x_key: str = "x"  # array names inside an .npz
    y_key: str = "y"
    eval_fraction: float = 0.0  # held out from train when no eval_path
    normalize_targets: bool = False
    text_field: str = "text"  # causal_lm: the column (parquet) or key (jsonl) holding text
    prompt_field: str = ""  # causal_lm: a column whose tokens come first and are not learned
    messages_field: str = ""  # causal_lm: a column of chat messages; assistant turns learned
    max_length: int = 1024  # causal_lm: tokens per staged row
    packing: bool = True  # causal_lm: many documents per row; false: one per row, padded
    tokenizer: str = ""  # causal_lm: tokenizer directory; "": the model's weights directory
    allow_nonfinite: bool = False  # stage NaN/inf values as they are (refused otherwise)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def _check_messages_alone(self) -> None:
        """A chat row is its messages alone: a prompt or text column beside them would be
        ignored, so naming one is refused (text_field counts once moved off its default)."""
        if not self.messages_field:
            return
        for key, default in (("prompt_field", ""), ("text_field", "text")):
            if getattr(self, key) != default:
                raise UserError(f"data.messages_field: {self.messages_field!r} is set with "
                                f"data.{key} {getattr(self, key)!r}; a chat row is its "
                                f"messages alone: remove data.{key} (or data.messages_field)")

    def validate(self) -> None:
        if not 2 <= self.max_length <= MAX_TEXT_LENGTH:
            raise UserError(f"data.max_length: {self.max_length!r} must be between 2 and "
                            f"{MAX_TEXT_LENGTH} tokens, e.g. 1024")
        for key in ("text_field", "prompt_field", "messages_field"):
            if "\n" in getattr(self, key) or "\0" in getattr(self, key):
                raise UserError(f"data.{key}: must be a column name on one line")
        if not self.text_field:
            raise UserError("data.text_field: is empty; name the column holding text, e.g. text")
        self._check_messages_alone()
        for key in ("train_path", "train_targets_path", "eval_path", "eval_targets_path"):
            no_credentials_in_url(f"data.{key}", getattr(self, key))
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError("data.eval_fraction: must be in [0, 1)")
        self.synthetic.validate()


@dataclass
class TrainingConfig:
    epochs: int = 1
    max_steps: int = 0  # 0: the epochs decide
    pause_at_step: int = 0  # end this launch here, checkpointed; the schedule stays max_steps
    per_device_train_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    global_batch_size: int = 0  # rows per optimizer step; 0: frozen at the first launch
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    lr_schedule: str = "cosine"  # after warmup: cosine | linear | constant
    min_lr_ratio: float = 0.1  # cosine and linear end at this x lr
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    eval_every_steps: int = 0  # also evaluate every N steps; 0: at epoch ends (and the end)
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0
    bf16: str = "auto"  # auto (GPU only) | true | false
    compile: bool = False  # torch.compile each block (the first steps pay for compilation)
    float8: bool = False  # the blocks' linears in float8 (torchao); emulated off H100/H200
    max_nonfinite_steps: int = 5  # abort after this many non-finite losses in a row
    nonfinite_policy: str = "skip_then_abort"  # skip | abort | skip_then_abort

    def validate(self) -> None:
        _bounded("training.epochs", self.epochs, MAX_COUNT)
        _non_negative("training.max_steps", self.max_steps)
        _bounded("training.max_steps", max(self.max_steps, 1), MAX_COUNT)
        _bounded("training.per_device_train_batch_size", self.per_device_train_batch_size,
                 MAX_BATCH_ROWS)
        _bounded("training.gradient_accumulation_steps", self.gradient_accumulation_steps,
                 MAX_BATCH_ROWS)
        _non_negative("training.global_batch_size", self.global_batch_size)
        _non_negative("training.pause_at_step", self.pause_at_step)
        _bounded("training.pause_at_step", max(self.pause_at_step, 1), MAX_COUNT)
        _non_negative("training.eval_every_steps", self.eval_every_steps)
        _bounded("training.eval_every_steps", max(self.eval_every_steps, 1), MAX_COUNT)
        _bounded("training.global_batch_size", max(self.global_batch_size, 1), MAX_GLOBAL_BATCH)
        _positive("training.max_nonfinite_steps", self.max_nonfinite_steps)
        _seed("training.seed", self.seed)
        if not self.lr > 0:
            raise UserError(f"training.lr: {self.lr} must be > 0, e.g. 1e-3")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("training.weight_decay / training.grad_clip: must be >= 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise UserError("training.warmup_ratio: must be in [0, 1)")
        _choice("training.lr_schedule", str(self.lr_schedule), ("cosine", "linear", "constant"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"training.min_lr_ratio: {self.min_lr_ratio!r} must be in [0, 1], "
                            "e.g. 0.1 (the decay ends at this x lr)")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise UserError(f"training.{key}: {getattr(self, key)!r} must be in [0, 1), "
                                "e.g. 0.9 and 0.999")
        if not 0.0 < self.adam_eps <= 1.0:
            raise UserError(f"training.adam_eps: {self.adam_eps!r} must be in (0, 1], e.g. 1e-8")
        _choice("training.bf16", str(self.bf16).lower(), ("auto", "true", "false"))
        _choice("training.nonfinite_policy", str(self.nonfinite_policy),
                ("skip", "abort", "skip_then_abort"))
        self.bf16 = str(self.bf16).lower()


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end (and every_minutes)
    every_minutes: float = 30.0  # also save when this long has passed since the last; 0: off
    keep_last: int = 3
    async_save: str = "auto"  # auto (GPU only) | true | false
    writer_threads: int = 0  # DCP writer threads (files) per rank; 0: 4 on GPU, 1 on CPU
    barrier_timeout_s: float = 0.0  # checkpoint/control-lane barriers; 0: parallel.timeout_s
    lustre_stripe_count: int = 4  # checkpoints/ on Lustre: OSTs per file; -1 all, 0 as is

    def validate(self) -> None:
        _non_negative("checkpoint.every_steps", self.every_steps)
        if not -1 <= self.lustre_stripe_count <= MAX_STRIPE_COUNT:
            raise UserError(f"checkpoint.lustre_stripe_count: {self.lustre_stripe_count!r} must "
                            f"be -1 (every OST), 0 (the filesystem's default) or 1 to "
                            f"{MAX_STRIPE_COUNT}")
        if not 0 <= self.every_minutes <= MAX_WAIT_S / 60:
            raise UserError(f"checkpoint.every_minutes: {self.every_minutes!r} must be >= 0 "
                            "(0: no time-based checkpoints) and at most a week")
        _positive("checkpoint.keep_last", self.keep_last)
        _choice("checkpoint.async_save", str(self.async_save).lower(), ("auto", "true", "false"))
        self.async_save = str(self.async_save).lower()
        if not 0 <= self.writer_threads <= MAX_WRITER_THREADS:
            raise UserError(f"checkpoint.writer_threads: {self.writer_threads!r} must be 0 "
                            f"(auto) to {MAX_WRITER_THREADS}")
        if not 0 <= self.barrier_timeout_s <= MAX_WAIT_S:
            raise UserError(f"checkpoint.barrier_timeout_s: {self.barrier_timeout_s!r} must be "
                            f">= 0 (0: parallel.timeout_s) and at most {MAX_WAIT_S:.0f} seconds")

    def async_on(self, device_type: str) -> bool:
        """Periodic saves in the background: `auto` means on GPU only (the copy to pinned
        host memory is what lets the GPU go on; on CPU the copy is the cost)."""
        return self.async_save == "true" or (self.async_save == "auto" and device_type == "cuda")

    def threads_on(self, device_type: str) -> int:
        return self.writer_threads or (GPU_WRITER_THREADS if device_type == "cuda" else 1)


@dataclass
class ParallelConfig:
    strategy: str = "hsdp"  # hsdp | fsdp | ddp
    nodes: int = 1  # launch shape; a launcher flag overrides it
    procs_per_node: int = 2  # one process per GPU on GPU nodes
    replicate: int = 0  # 0: number of nodes
    shard: int = 0  # 0: processes per node
    timeout_s: float = 300.0  # every collective and barrier gives up after this
    max_restarts: int = 0
    stop_grace_s: float = 60.0  # after SIGTERM under Slurm: exit hard if no checkpoint by then
    reduce_dtype: str = "fp32"  # gradient reductions under bf16 mixed precision: fp32 | bf16
    rendezvous_timeout_s: float = 900.0  # all ranks must meet within this (image unpack skew)
    watchdog_s: float = 0.0  # no progress for this long ends the rank; 0: timeout_s + 60
    # none | selective (per op: matmul outputs kept) | every_other (block) | full
    activation_checkpointing: str = "none"

    @property
    def watchdog_limit_s(self) -> float:
        """After the collectives' own timeout: the watchdog catches what has none."""
        return self.watchdog_s or self.timeout_s + 60.0

    def validate(self) -> None:
        _choice("parallel.strategy", self.strategy, ("hsdp", "fsdp", "ddp"))
        _choice("parallel.reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        _choice("parallel.activation_checkpointing", self.activation_checkpointing,
                CHECKPOINTING_MODES)
        _bounded("parallel.nodes", self.nodes, MAX_NODES)
        _bounded("parallel.procs_per_node", self.procs_per_node, MAX_PROCS_PER_NODE)
        _non_negative("parallel.replicate", self.replicate)
        _non_negative("parallel.shard", self.shard)
        _non_negative("parallel.max_restarts", self.max_restarts)
        if not 0 < self.timeout_s <= MAX_WAIT_S:
            raise UserError(f"parallel.timeout_s: {self.timeout_s!r} must be > 0 and at most "
                            f"{MAX_WAIT_S:.0f} seconds (a week)")
        if not 0 < self.rendezvous_timeout_s <= MAX_WAIT_S:
            raise UserError(f"parallel.rendezvous_timeout_s: {self.rendezvous_timeout_s!r} must "
                            f"be > 0 and at most {MAX_WAIT_S:.0f} seconds (a week)")
        if not 0 <= self.stop_grace_s <= MAX_WAIT_S:
            raise UserError(f"parallel.stop_grace_s: {self.stop_grace_s!r} must be >= 0 and at "
                            f"most {MAX_WAIT_S:.0f} seconds (a week)")
        if not 0 <= self.watchdog_s <= MAX_WAIT_S:
            raise UserError(f"parallel.watchdog_s: {self.watchdog_s!r} must be >= 0 (0: "
                            f"timeout_s + 60) and at most {MAX_WAIT_S:.0f} seconds (a week)")
        # the mesh (replicate x shard) is checked by the launch plan, against the world the
        # launch flags give (client/launch_plan.py): nodes and procs_per_node are defaults


@dataclass
class LoggingConfig:
    metrics_path: str = "metrics.jsonl"  # relative to the run directory
    every_steps: int = 0  # 0: 10 on GPU, 1 on CPU
    mlflow_tracking_uri: str = ""  # "": no MLflow; credentials only through the environment
    mlflow_experiment: str = "enn_cluster"

    def validate(self) -> None:
        _non_negative("logging.every_steps", self.every_steps)
        check_metrics_path("logging.metrics_path", self.metrics_path)
        no_credentials_in_url("logging.mlflow_tracking_uri", self.mlflow_tracking_uri,
                              "MLFLOW_TRACKING_TOKEN (or _USERNAME/_PASSWORD)")
        if not self.mlflow_experiment.strip():
            raise UserError("logging.mlflow_experiment: must not be empty")

    def steps_on(self, device_type: str) -> int:
        """Steps between `train` records: each reads loss and norm back from the device,
        which on a GPU waits for the queued work (a host sync); on CPU there is none."""
        return self.every_steps or (GPU_LOG_EVERY_STEPS if device_type == "cuda" else 1)


@dataclass
class ProfilingConfig:
    steps: str = ""  # "A-B" (or "A"): optimizer steps traced by torch.profiler; "": off

    def validate(self) -> None:
        profile_window(self.steps)

    @property
    def window(self) -> Optional[tuple[int, int]]:
        return profile_window(self.steps)


MAX_PROFILED_STEPS = 100  # a trace grows with every step it holds


def profile_window(text: str) -> Optional[tuple[int, int]]:
    """`"20-25"` -> (20, 25), `"20"` -> (20, 20), `""` -> None; anything else refused."""
    text = str(text).strip()
    if not text:
        return None
    first, sep, last = text.partition("-")
    if not (first.isdigit() and (last.isdigit() or not sep)):
        raise UserError(f"profiling.steps: {text[:40]!r} is not a step range; give FIRST-LAST "
                        "(optimizer steps, from 1), e.g. profiling.steps=20-25")
    lo, hi = int(first), int(last if sep else first)
    if not 1 <= lo <= hi:
        raise UserError(f"profiling.steps: {text!r} must run from step 1 or later, forwards")
    if hi - lo + 1 > MAX_PROFILED_STEPS:
        raise UserError(f"profiling.steps: {hi - lo + 1} steps is too many to trace; keep it "
                        f"to {MAX_PROFILED_STEPS} or fewer (a few steps show the pattern)")
    return lo, hi


@dataclass
class RunConfig:
    run_name: str = "run"
    runs_root: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def validate(self) -> "RunConfig":
        if not self.run_name or "/" in self.run_name or self.run_name in (".", "..") \
                or any(c in self.run_name for c in "\n\r\0"):
            raise UserError(f"run_name: {self.run_name!r} must be a non-empty name "
                            "without '/' or newlines")
        _path_text("run_name", self.run_name)
        if len(self.run_name.encode("utf-8")) > MAX_NAME_BYTES:
            raise UserError(f"run_name: {len(self.run_name.encode('utf-8'))} bytes is too long "
                            f"for a directory name; keep it under {MAX_NAME_BYTES}")
        if not self.runs_root:
            raise UserError("runs_root: is empty; give a directory, e.g. runs")
        _path_text("runs_root", self.runs_root)
        check_home("runs_root", self.runs_root)
        for section in (self.model, self.data, self.lora, self.training, self.checkpoint,
                        self.parallel, self.logging, self.profiling):
            section.validate()
        if self.lora.enabled and not takes_lora(self.model):
            raise UserError(f"lora.r: LoRA needs a Hugging Face model (model.name: hf:/dir); "
                            f"{self.model.name!r} is not one: set lora.r=0")
        if self.lora.enabled and self.training.float8:
            raise UserError("training.float8: not with LoRA (lora.r > 0): the frozen base's "
                            "matmuls would run in float8 under the adapters; set "
                            "training.float8: false, or lora.r: 0 for a full fine-tune")
        return self


@dataclass(frozen=True)
class MeshPlan:
    """Degrees of the 2-D mesh: replicate across nodes, shard inside a node."""

    strategy: str
    replicate: int
    shard: int

    @property
    def world(self) -> int:
        return self.replicate * self.shard

    @property
    def sharded(self) -> bool:
        """FSDP2 holds each parameter in shards (fsdp, hsdp); DDP holds it whole."""
        return self.strategy != "ddp"


def plan_mesh(par: ParallelConfig, world: int, local_world: int) -> MeshPlan:
    """Decide mesh degrees for a world; the same rule at launch and at every restart."""
    if par.strategy == "fsdp":
        return MeshPlan("fsdp", 1, world)
    if par.strategy == "ddp":
        return MeshPlan("ddp", world, 1)
    shard = par.shard or local_world
    replicate = par.replicate or max(world // shard, 1)
    if replicate * shard != world:
        raise UserError(f"parallel.replicate, parallel.shard: {replicate} x {shard} does not "
                        f"equal the world size {world}; set them so their product is {world} "
                        "(or 0 for automatic)")
    return MeshPlan("hsdp", replicate, shard)
