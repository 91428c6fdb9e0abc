"""The config reference (docs/config.md), generated from the dataclasses in `config.py`.

    python -m enn_cluster.config.docs            # print it
    python -m enn_cluster.config.docs --write    # rewrite docs/config.md

Names, types and defaults come from the dataclasses; the one-line descriptions live in
DESCRIPTIONS below, keyed by the dotted key `--set` uses (`training.lr`). A field without a
description, or a description without a field, raises: adding a config field forces a doc
update, and tests/repo/test_docs.py fails while docs/config.md is stale. Pure; no torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from enn_cluster.config.run_config import RunConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
WRITE_COMMAND = "python -m enn_cluster.config.docs --write"

SECTION_INTROS = {
    "": "Where the run directory goes and what it is called.",
    "model": "The network: a built-in `mlp` or `transformer`, or your own "
             "`package.module:factory`.",
    "data": "Training and evaluation arrays, staged once into memmaps in `RUN_DIR/data/`.",
    "lora": "LoRA adapters for a Hugging Face causal LM (`model.name: hf:...`): the base "
            "weights stay frozen, checkpoints hold the adapters and their optimizer state.",
    "data.synthetic": "The generated data set used when `data.train_path` is `synthetic`.",
    "training": "Optimisation: steps, batch, learning-rate schedule, precision, non-finite "
                "guard.",
    "checkpoint": "DCP checkpoints in `RUN_DIR/checkpoints/step-N/`, complete only with "
                  "`commit.json`.",
    "parallel": "Launch shape and the HSDP/FSDP/DDP mesh; launcher flags override "
                "`nodes`/`procs_per_node`.",
    "logging": "Rank-0 metrics as JSON lines.",
    "profiling": "torch.profiler traces of chosen optimizer steps, per rank.",
}

DESCRIPTIONS = {
    "run_name": "Name of the run directory under `runs_root`; no `/` or newlines.",
    "runs_root": "Directory that holds run directories (on a cluster: the shared "
                 "filesystem); made absolute at launch.",
    # model
    "model.name": "`mlp`, `transformer`, `package.module:factory` (called with "
                  "`n_features`, `n_outputs` and `model.kwargs`; must import on every node), or "
                  "`hf:/weights/dir`: a Hugging Face causal LM (its `config.json`, safetensors "
                  "weights and tokenizer), read locally, never from the network.",
    "model.task": "`regression` (MSE loss), `classification` (cross-entropy on integer "
                  "labels) or `causal_lm` (next-token cross-entropy; implied by `hf:` models); "
                  "a model's own `loss()` wins.",
    "model.hidden_sizes": "MLP hidden layer widths, a list of positive integers.",
    "model.d_model": "Transformer width; must be divisible by `model.n_heads`.",
    "model.n_layers": "Transformer encoder layers (> 0).",
    "model.n_heads": "Transformer attention heads (> 0).",
    "model.dropout": "Dropout probability for the built-in models, in [0, 1).",
    "model.kwargs": "Extra keyword arguments passed to a user `module:factory`; checked "
                    "against its signature before anything is written.",
    # data
    "data.train_path": "`.npy`/`.npz` path or fsspec URL of the training inputs, or "
                       "`synthetic`.",
    "data.train_targets_path": "`.npy` of training targets; required when "
                               "`data.train_path` is a `.npy`.",
    "data.eval_path": "Evaluation inputs (`.npy`/`.npz`/URL); when unset, "
                      "`data.eval_fraction` holds rows out of the training set.",
    "data.eval_targets_path": "`.npy` of evaluation targets when `data.eval_path` is a "
                              "`.npy`.",
    "data.x_key": "Name of the inputs array inside an `.npz`.",
    "data.y_key": "Name of the targets array inside an `.npz`.",
    "data.eval_fraction": "Fraction of the training rows (the last ones) held out for "
                          "evaluation when there is no `data.eval_path`, in [0, 1).",
    "data.normalize_targets": "Regression only: train on per-output standardised targets "
                              "(mean/std of the training rows, stored in the data manifest).",
    "data.text_field": "Causal LM: the column (`.parquet`) or key (`.jsonl`) of "
                       "`data.train_path`/`data.eval_path` that holds the text.",
    "data.prompt_field": "Causal LM: a column whose text comes before `data.text_field` and "
                         "is masked out of the loss (prompt/response pairs); empty: none.",
    "data.messages_field": "Causal LM: a column (key) holding a chat, a list of "
                           "`{\"role\", \"content\"}` messages (system, user, assistant), "
                           "rendered by the tokenizer's own `chat_template` (a message's "
                           "other keys, such as Qwen3's `reasoning_content`, are handed to "
                           "it too, as transformers does); only the "
                           "assistant turns are learned (their text and the end-of-turn token "
                           "after it; a template that renders earlier turns otherwise once "
                           "a later one exists, as Qwen3 drops their reasoning, stages each "
                           "assistant turn as the conversation through it). Not with `data.prompt_field`, nor a `data.text_field` "
                           "other than its default; empty: none.",
    "data.max_length": "Causal LM: tokens per staged row (2 .. 1048576); token arrays "
                       "may be no wider (the memory plan counts rows of this length). A "
                       "model with learned positions (GPT-2, OPT) takes rows of at most "
                       "its `max_position_embeddings` (`n_positions`) tokens.",
    "data.packing": "Causal LM: pack many documents per row (no padding; in training each "
                    "attends only to itself, positions restarting after each EOS), or, "
                    "when false, one document per row, truncated or padded with pads masked "
                    "out of the loss. Packed text is refused for an architecture that does "
                    "not keep the documents apart (Bloom, MPT, OPT).",
    "data.tokenizer": "Causal LM: directory of the tokenizer files; empty: the model's "
                      "weights directory. Every id it gives must be below the model's "
                      "`vocab_size` (checked at staging).",
    "lora.r": "Adapter rank; 0 (the default) fine-tunes every weight, > 0 trains LoRA "
              "adapters only. Initialisation (whatever the world size): each `lora_A` "
              "uniform in [-1/sqrt(in), 1/sqrt(in)] (in: its input features) from a "
              "generator seeded by `training.seed` x 1000003 + crc32(its parameter name), "
              "each `lora_B` zero, so training starts from the base model's output.",
    "lora.alpha": "LoRA scaling numerator (the update is scaled by alpha / r).",
    "lora.dropout": "Dropout on the adapters' input, in [0, 1).",
    "lora.target_modules": "The layers that get adapters: `attention`, the decoder "
                           "layers' attention projections whatever the architecture names "
                           "them (Llama's, Qwen's, Mistral's `q_proj, k_proj, v_proj, "
                           "o_proj`, Phi-3's `qkv_proj, o_proj`, GPT-NeoX's and Falcon's "
                           "`query_key_value, dense`, GPT-2's `c_attn, attn.c_proj`); "
                           "`all-linear`, every linear layer of the decoder layers (the "
                           "MLP's too); or a list of module names (peft's `target_modules`, "
                           "matched as peft does: a module's name or its end after a dot), "
                           "e.g. `[q_proj, v_proj]`, each naming a linear, embedding or "
                           "convolution layer of the model. Checked before anything is "
                           "written; the peft export's adapter_config.json lists the names "
                           "the words stood for.",
    "data.allow_nonfinite": "Stage NaN and inf values as they are; by default staging "
                            "refuses them, naming the array, the first column and the row "
                            "count.",
    "data.synthetic.n_samples": "Rows to generate (> 0).",
    "data.synthetic.n_features": "Input features per row (> 0).",
    "data.synthetic.n_outputs": "Target columns (> 0); for classification, the class count "
                                "is at least 2.",
    "data.synthetic.noise": "Standard deviation of Gaussian noise added to the targets "
                            "(>= 0).",
    "data.synthetic.seed": "Seed of the generator: the same seed gives the same data.",
    # training
    "training.epochs": "Passes over the training rows (> 0); used when "
                       "`training.max_steps` is 0.",
    "training.max_steps": "Total optimizer steps; 0 lets `training.epochs` decide.",
    "training.pause_at_step": "End this launch at this step with a checkpoint (exit 0), the "
                              "learning-rate schedule still that of the whole run; a "
                              "`resume` from there goes on to the end (0: no pause). A run "
                              "split in parts this way matches an uninterrupted one.",
    "training.per_device_train_batch_size": "Largest micro-batch per process (> 0). At the "
                                            "first launch the global batch is this x "
                                            "accumulation x data-parallel size.",
    "training.gradient_accumulation_steps": "Micro-batches per optimizer step at the first "
                                            "launch (> 0); later starts derive it from the "
                                            "global batch. Gradients all-reduce only on the "
                                            "last one.",
    "training.global_batch_size": "Rows per optimizer step, frozen into the run at its first "
                                  "launch (0 there: computed). Every start at another world "
                                  "size splits it into micro-batch x accumulation x ranks, so "
                                  "steps, learning rates and row order match an "
                                  "uninterrupted run. Setting it on resume re-plans the "
                                  "schedule from the current step.",
    "training.lr": "Peak AdamW learning rate (> 0).",
    "training.weight_decay": "AdamW weight decay (>= 0), decoupled as torch's AdamW "
                             "applies it, to every trained parameter.",
    "training.warmup_ratio": "Fraction of the total steps spent in linear warmup, in [0, "
                             "1): W = floor(total steps x ratio) steps, step s (from 0) at "
                             "`lr` x (s + 1) / W; then `lr_schedule`.",
    "training.lr_schedule": "After warmup: `cosine` (the default) or `linear` decay from "
                            "`lr` to `min_lr_ratio` x `lr` at the last step, or `constant` "
                            "`lr`. Step s of T after W warmup steps: p = (s - W) / (T - W); "
                            "cosine: `lr` x (m + (1 - m) x (1 + cos(pi p)) / 2), linear: "
                            "`lr` x (m + (1 - m) x (1 - p)).",
    "training.min_lr_ratio": "Where `cosine` and `linear` decay end, as a fraction of `lr` "
                             "(m above), in [0, 1].",
    "training.adam_beta1": "AdamW's beta1, in [0, 1); a resume takes a new value.",
    "training.adam_beta2": "AdamW's beta2, in [0, 1); a resume takes a new value.",
    "training.adam_eps": "AdamW's epsilon, in (0, 1]; a resume takes a new value.",
    "training.eval_every_steps": "Also evaluate on the eval rows (`data.eval_path` or "
                                 "`data.eval_fraction`) every N optimizer steps; 0: at each "
                                 "epoch's end only. Every run that trains evaluates once "
                                 "more at its last step (a `max_steps` run shorter than an "
                                 "epoch included), not at a stop that will be resumed.",
    "training.grad_clip": "Clip the global gradient norm to this value; 0 disables clipping.",
    "training.seed": "Seed for the initial weights and the per-epoch data permutation.",
    "training.bf16": "`auto` (bf16 on GPU only), `true` or `false`; FSDP keeps fp32 "
                     "gradient reduction.",
    "training.float8": "Run the matmuls of the blocks' linear layers (every `nn.Linear` inside "
                       "a decoder layer whose dims are multiples of 16) in float8 with "
                       "torchao's dynamic tensorwise scaling, the weights all-gathered in "
                       "float8 under FSDP2 (torchtitan's recipe), on H100/H200-class GPUs. "
                       "Embeddings, the head and norms stay in "
                       "bf16; master weights and Adam states stay fp32, so checkpoints do "
                       "not change. Off H100/H200 (CPU, older GPUs) torchao emulates float8: "
                       "same numerics, slow, for checking a config. Needs "
                       "`pip install 'enn_cluster[float8]'` (torchao); not with LoRA.",
    "training.compile": "`torch.compile` each block (decoder layer) before sharding; the "
                        "first steps pay for the compilation.",
    "training.max_nonfinite_steps": "Abort after this many non-finite losses/gradient norms "
                                    "in a row (each such step is skipped on the device); "
                                    "checked on `logging.every_steps` steps.",
    "training.nonfinite_policy": "What a non-finite loss or gradient does: `skip` the step "
                                 "(on the device) and go on, `abort` training, or "
                                 "`skip_then_abort` after `max_nonfinite_steps` in a row. "
                                 "Each skip writes `nonfinite/step-N.json` (rows, "
                                 "non-finite parameters, lr, norm); checked on log steps.",
    # checkpoint
    "checkpoint.every_steps": "Save a checkpoint every N optimizer steps; 0 saves only at "
                              "the end, on a requested stop and every `every_minutes`.",
    "checkpoint.every_minutes": "Also save when this many minutes have passed since the "
                                "last save (or the start), so a crash in a first run loses "
                                "at most that much; every rank agrees on the step through "
                                "the step's control-lane all-reduce. 0: no time-based saves.",
    "checkpoint.writer_threads": "Writer threads per rank, each writing its own file of the "
                                 "rank's shard; 0: 4 on GPU, 1 on CPU.",
    "checkpoint.lustre_stripe_count": "When the run directory is on Lustre (its `lfs` tool "
                                      "at hand where the run is made): the stripe count set "
                                      "on `checkpoints/`, so that each shard file spreads "
                                      "over that many OSTs; -1 every OST, 0 leaves the "
                                      "filesystem's default (docs/admin.md).",
    "checkpoint.keep_last": "Committed checkpoints to keep (> 0); older ones, and torn ones "
                            "older than the newest committed, are deleted.",
    "checkpoint.async_save": "Write periodic checkpoints in the background: a thread copies "
                             "what this rank writes of model + optimizer state (with HSDP "
                             "each shard is written by one replica) into host memory reserved "
                             "at start (one copy, pinned on GPU nodes), then writes and "
                             "commits on its own gloo group; the next optimizer step waits "
                             "only while that copy runs. The final checkpoint is always "
                             "synchronous. `auto`: on GPU only; `true` or `false`.",
    "checkpoint.barrier_timeout_s": "Timeout in seconds of the checkpoint barriers and of the "
                                    "control lane that carries them (a save waits for the "
                                    "slowest writer; a resume for the slowest load); 0: "
                                    "`parallel.timeout_s`. Raise it for big models on slow "
                                    "shared filesystems (e.g. 1800).",
    # parallel
    "parallel.strategy": "`hsdp` (shard inside a node, replicate across nodes), `fsdp` "
                         "(shard over all ranks) or `ddp`.",
    "parallel.nodes": "Nodes to launch on (simulated locally); `--nodes` overrides it.",
    "parallel.procs_per_node": "Processes per node; one per GPU on GPU nodes; "
                               "`--procs-per-node`/`--gpus-per-node` override it.",
    "parallel.replicate": "HSDP replicate degree; 0 = world size / shard.",
    "parallel.shard": "HSDP shard degree; 0 = processes per node. "
                      "`replicate x shard` must equal the world size.",
    "parallel.timeout_s": "Timeout in seconds of every collective: a dead peer ends the job "
                          "instead of hanging it (> 0). The rendezvous and the checkpoint "
                          "barriers have their own settings.",
    "parallel.rendezvous_timeout_s": "How long the ranks wait for each other at start "
                                     "(TCPStore and process-group setup), in seconds. On a "
                                     "restart every node unpacks the image again and nodes "
                                     "can start minutes apart: keep this well above that skew.",
    "parallel.activation_checkpointing": "Recompute activations in the backward pass: `none`; "
                                         "`selective`, per op as torchtitan does (every "
                                         "block keeps its attention and every other matmul "
                                         "output, recomputes the cheap ops: about a third of "
                                         "the memory for a few % more compute); "
                                         "`every_other` block whole; or `full` (every block: "
                                         "least memory, about a third more compute).",
    "parallel.watchdog_s": "A rank that starts no step, collective or evaluation batch "
                           "for this long logs where each lane was, dumps every thread's "
                           "stack and exits 70 (retried like a failure); 0: "
                           "`timeout_s` + 60. Checkpoint saves and loads are not timed; the "
                           "first step of each process with `training.compile` gets 1800 s "
                           "more (a cold compile is not a hang).",
    "parallel.max_restarts": "Retries after a worker failure (default of `--max-restarts`); "
                             "each restart resumes from the newest complete checkpoint.",
    "parallel.stop_grace_s": "After SIGTERM: exit hard if the agreed checkpoint is not "
                             "reached within this many seconds. The local launcher's elastic "
                             "agent waits this long plus 10 s after a TERM or INT before it "
                             "kills the workers; on torch releases whose LaunchConfig has no "
                             "`shutdown_timeout`, 30 s whatever this says.",
    "parallel.reduce_dtype": "Dtype of the gradient reductions when parameters run in bf16 "
                             "(`training.bf16`): `fp32` (default) or `bf16`. bf16 halves the "
                             "bytes of the inter-node all-reduce (HSDP) and of the intra-node "
                             "reduce-scatter (FSDP2 has one reduce dtype for both), at the "
                             "price of summing gradients with an 8-bit mantissa: small "
                             "gradients from many ranks lose precision, so keep fp32 unless "
                             "the inter-node links are the bottleneck, and compare loss "
                             "curves when switching.",
    # logging
    "logging.metrics_path": "Metrics file: `metrics.jsonl` or a `.jsonl` file under `metrics/` "
                            "in the run directory (never one of its control files).",
    "logging.every_steps": "Write a `train` metrics record every N steps, and at every "
                           "checkpoint and the last step: the only steps whose loss and norm "
                           "are read back from the device (a host sync on GPU). 0: 10 on "
                           "GPU, 1 on CPU.",
    "logging.mlflow_tracking_uri": "MLflow tracking URI; empty: no MLflow. Rank 0 logs into "
    "one MLflow run across restarts (needs the `mlflow` extra). No credentials in the URI: "
    "use MLFLOW_TRACKING_TOKEN in the environment.",
    "logging.mlflow_experiment": "MLflow experiment the run is created in.",
    # profiling
    "profiling.steps": "`FIRST-LAST` (or one step): optimizer steps traced by "
                       "torch.profiler, one Chrome trace per rank in "
                       "`profiles/steps-FIRST-LAST/rank-R.json` (and an MLflow artifact when "
                       "tracking is on); empty: off. At most 100 steps.",
}


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted, as `--set` takes it
    type: str
    default: str
    description: str


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if dataclasses.is_dataclass(tp):
        return "section"
    names = {list: "list", dict: "mapping", str: "str", int: "int", float: "float",
             bool: "bool"}
    return names.get(origin or tp, getattr(tp, "__name__", str(tp)))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    raise ValueError(f"config field {f.name} has no default")


def _walk(cls: type, prefix: str) -> Iterator[tuple[str, type, list]]:
    """(section key, dataclass, fields) for `cls` and every nested section, in order."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    yield prefix, cls, [(f, hints[f.name]) for f in fields if not dataclasses.is_dataclass(hints[f.name])]
    for f in fields:
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            key = f"{prefix}.{f.name}" if prefix else f.name
            yield from _walk(tp, key)


def field_docs(descriptions: dict = DESCRIPTIONS, root: type = RunConfig) -> dict:
    """Section key -> [FieldDoc]; ValueError when a field and its description disagree."""
    out: dict = {}
    seen: set = set()
    missing: list = []
    for section, cls, fields in _walk(root, ""):
        docs = []
        for f, tp in fields:
            key = f"{section}.{f.name}" if section else f.name
            seen.add(key)
            if key not in descriptions:
                missing.append(key)
                continue
            default = json.dumps(_default(f), ensure_ascii=False)
            docs.append(FieldDoc(key, _type_name(tp), default, descriptions[key]))
        out[section] = docs
        if section not in SECTION_INTROS:
            missing.append(f"section {section!r} (SECTION_INTROS)")
    if missing:
        raise ValueError(f"config fields or sections without a description in enn_cluster/config/docs.py "
                         f"DESCRIPTIONS: {', '.join(missing)}; add one line each, then run "
                         f"`{WRITE_COMMAND}`")
    stale = sorted(set(descriptions) - seen)
    if stale:
        raise ValueError(f"DESCRIPTIONS in enn_cluster/config/docs.py names fields that "
                         f"config.py no longer has: {', '.join(stale)}; remove them")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_config_reference(descriptions: dict = DESCRIPTIONS) -> str:
    """The whole docs/config.md text (pure: same input, same text)."""
    sections = field_docs(descriptions)
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `" + WRITE_COMMAND + "` from enn_cluster/config/run_config.py "
        "and the descriptions in enn_cluster/config/docs.py. Do not edit by hand. -->",
        "",
        "A run YAML (`enn-submit train --config RUN.yaml`) has the sections below; every key "
        "is optional and unknown keys are an error. Any key can be overridden on the command "
        "line with `--set KEY=VALUE` (the value is parsed as YAML), e.g. "
        "`--set training.lr=1e-4 --set model.hidden_sizes=[128,128]`. The resolved config is "
        "frozen into `RUN_DIR/config.yaml`; `enn-submit resume RUN_DIR --set ...` re-freezes "
        "it (older versions go to `config-history/`). Example: "
        "[examples/demo.yaml](../examples/demo.yaml).",
        "",
        "Defaults are shown as YAML/JSON values; `null` means unset.",
        "",
    ]
    for section, docs in sections.items():
        if not docs:
            continue
        title = f"`{section}`" if section else "Top level"
        lines += [f"## {title}", "", SECTION_INTROS[section], "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        for d in docs:
            lines.append(f"| `{d.key}` | {d.type} | `{_cell(d.default)}` | "
                         f"{_cell(d.description)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m enn_cluster.config.docs",
                                     description="Print or write the config reference.")
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    args = parser.parse_args(argv)
    text = render_config_reference()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
