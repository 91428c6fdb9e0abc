"""Shared pieces of the language-model tests: a tiny real model written by save_pretrained,
token rows made with its own tokenizer, and run configs around them."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from enn_cluster.client.llm_assets import corpus, write_texts, write_tiny_model
from helpers import cli, with_sections, write_config


PRECISIONS = ("fp32", "bf16")  # every LM test class runs both (pytest params)
RESERVED_IDS = 4000  # bf16 models: every real token id is above this (bf16 spacing 16-32)


_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
# Tiny shapes of the other architectures users bring (llm_assets.ARCHS has llama, qwen2,
# gpt2, opt), with what their real checkpoints set that changes the math (Granite-3's
# multipliers and logits_scaling); no dropout, so that runs are exact against transformers;
# weights drawn wider where the architecture shrinks its logits (Cohere's logit_scale,
# Granite's logits_scaling), so that a wrong head or documents that see each other change
# the loss.
SHAPES = {
    "mistral": dict(_BASE, num_key_value_heads=2),
    "qwen3": dict(_BASE, num_key_value_heads=2, head_dim=16),
    "phi3": dict(_BASE, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
                 attention_dropout=0.0, original_max_position_embeddings=64),
    "phi": dict(_BASE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gemma": dict(_BASE, num_key_value_heads=2, head_dim=16),
    "gemma2": dict(_BASE, num_key_value_heads=2, head_dim=16, sliding_window=16,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(_BASE, num_key_value_heads=2, head_dim=16, sliding_window=16,
                        query_pre_attn_scalar=16),
    "olmo2": dict(_BASE, num_key_value_heads=2),
    "granite": dict(_BASE, num_key_value_heads=2, logits_scaling=8.0, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.0625,
                    initializer_range=0.1),
    "stablelm": dict(_BASE, num_key_value_heads=2, **_NO_DROPOUT),
    "starcoder2": dict(_BASE, num_key_value_heads=2, residual_dropout=0.0,
                       embedding_dropout=0.0, attention_dropout=0.0),
    "cohere": dict(_BASE, num_key_value_heads=2, initializer_range=0.2),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_NO_DROPOUT),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                        embd_pdrop=0.0, resid_pdrop=0.0),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, **_NO_DROPOUT),
    "gpt_neox": dict(_BASE, tie_word_embeddings=False, **_NO_DROPOUT),
    "mixtral": dict(_BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


def tiny_model(root: Path, arch: str = "llama", precision: str = "fp32", **shape) -> Path:
    """A tiny model + tokenizer under `root` (made once per root, arch and precision).
    "bf16" is the users' world: weights saved in bf16 (config.json says bfloat16, as every
    Llama-3 and Qwen2.5 does) and a vocabulary whose ids all lie above RESERVED_IDS, where
    bf16 holds only every 16th integer."""
    path = root / (f"tiny-{arch}" if precision == "fp32" else f"tiny-{arch}-{precision}")
    shape = {**SHAPES.get(arch, {}), **shape}
    if not (path / "config.json").exists():
        if precision == "bf16":
            shape = {"dtype": "bfloat16", "reserved": RESERVED_IDS, **shape}
        write_tiny_model(path, arch, **shape)
    return path


# Chat templates as real models write them, each with `{% generation %}` markers around what
# transformers' assistant mask (the oracle) learns; `unmarked` strips them, as Qwen2.5's and
# Llama-3's own templates have none.
CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
QWEN_TEMPLATE = (  # Qwen2.5's, without tools: a default system turn, ChatML's newline after
    r"""{%- if messages[0]['role'] == 'system' %}"""
    r"""{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"""
    r"""{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"""
    r"""{%- endif %}{%- for message in messages %}"""
    r"""{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"""
    r"""{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"""
    r"""{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"""
    r"""{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"""
    r"""{%- endif %}{%- endfor %}"""
    r"""{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}""")
LLAMA3_TEMPLATE = (  # Llama-3-Instruct's: BOS once, headers, content trimmed, <|eot_id|>
    r"""{% for message in messages %}"""
    r"""{% set head = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}"""
    r"""{% if loop.index0 == 0 %}{% set head = bos_token + head %}{% endif %}{{ head }}"""
    r"""{% if message['role'] == 'assistant' %}{% generation %}"""
    r"""{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"""
    r"""{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"""
    r"""{% if add_generation_prompt %}"""
    r"""{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}""")
CHAT_TEMPLATES = {"qwen2.5": QWEN_TEMPLATE, "llama-3": LLAMA3_TEMPLATE}


def unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def chat_model(root: Path, precision: str = "fp32") -> Path:
    """tiny_model with the chat special tokens in its vocabulary and Qwen2.5's template
    (unmarked) in its tokenizer."""
    return tiny_model(root, precision=precision, chat_specials=CHAT_SPECIALS,
                      chat_template=unmarked(QWEN_TEMPLATE))


def with_template(model_dir: Path, dest: Path, template: str | None) -> Path:
    """The model's tokenizer files in `dest`, with `template` (None: none) as its
    chat_template.jinja."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    return dest


def chats(n: int, seed: int = 0) -> list[list[dict]]:
    """Deterministic conversations: a system turn or not, then 1 to 3 user/assistant pairs."""
    import random

    rng, words = random.Random(seed), corpus(6 * n + 6, seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": words.pop()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": words.pop()},
                      {"role": "assistant", "content": words.pop()}]
        out.append(turns)
    return out


def oracle_chat(marked_dir: Path, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """transformers' own ids and assistant mask of a conversation, from a tokenizer whose
    template has `{% generation %}` markers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(marked_dir), local_files_only=True)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def bf16_training(precision: str) -> dict:
    """The `training` keys of a run in `precision`: bf16 compute for a bf16 model."""
    return {"bf16": "true"} if precision == "bf16" else {}


def checkpoint_dtypes(step_dir: Path) -> dict:
    """{tensor name: dtype} from a DCP checkpoint's metadata (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata()
    return {name: str(m.properties.dtype).replace("torch.", "")
            for name, m in meta.state_dict_metadata.items() if hasattr(m, "properties")}


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def packed_tokens(model_dir: Path, rows: int, length: int, seed: int = 3) -> np.ndarray:
    """`rows` x `length` token ids: the corpus encoded by the model's own tokenizer, each
    document followed by EOS, cut into rows (what packed staging makes)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids: list[int] = []
    for text in corpus(rows * length // 4 + 50, seed):
        ids += tok(text).input_ids + [tok.eos_token_id]
        if len(ids) >= rows * length:
            break
    assert len(ids) >= rows * length
    return np.array(ids[:rows * length], np.int32).reshape(rows, length)


def token_files(tmp: Path, model_dir: Path, rows: int, length: int) -> tuple[Path, Path]:
    x = packed_tokens(model_dir, rows, length)
    np.save(tmp / "ids.npy", x)
    np.save(tmp / "labels.npy", x)
    return tmp / "ids.npy", tmp / "labels.npy"


def lm_config(tmp: Path, model_dir: Path, name: str, rows: int = 64, length: int = 32,
              **over) -> dict:
    x, y = token_files(tmp, model_dir, rows, length)
    cfg = {
        "run_name": name, "runs_root": str(tmp / "runs"),
        "model": {"name": f"hf:{model_dir}"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"train_path": str(x), "train_targets_path": str(y), "max_length": length},
        "training": {"epochs": 2, "per_device_train_batch_size": 2, "lr": 3e-3,
                     "warmup_ratio": 0.1, "seed": 5},
        "checkpoint": {"every_steps": 4, "keep_last": 5},
        "parallel": {"nodes": 1, "procs_per_node": 2},
    }
    return with_sections(cfg, over)


def stage_text(tmp: Path, cfg: dict) -> tuple[dict, Path]:
    """The run config `cfg`'s text staged into tmp/staged: (manifest, that directory)."""
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.storage.staging import stage_run_data

    run_cfg = config_from_dict(cfg)
    out = tmp / "staged"
    out.mkdir()
    return stage_run_data(run_cfg.data, run_cfg.model, out, text=True), out


def prepare_text(tmp: Path, cfg: dict, env=None):
    """`enn-submit prepare` of `cfg` on one CPU rank (the real CLI: staging included)."""
    path = write_config(tmp / "lm.yaml", **cfg)
    return cli("prepare", "--config", path, "--nodes", "1", "--procs-per-node", "1",
               "--gpus-per-node", "0", timeout=120, env=env)


def assert_refused_before_any_run(res, tmp: Path, needles: list[str]) -> None:
    """A prepare that said one line (exit 2) holding every needle, and made no run."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("enn-submit: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    runs = tmp / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def reference_losses(model_dir: Path, ids: np.ndarray, steps: int, batch: int, lr: float,
                     warmup_ratio: float, seed: int, lora: dict | None = None,
                     precision: str = "fp32", grad_clip: float = 1.0,
                     labels: np.ndarray | None = None, float8: bool = False) -> list[float]:
    """A plain transformers (+ peft) loop, the oracle our trainer's losses are held to: fp32
    master weights and AdamW states (a bf16 checkpoint upcast), bf16 autocast for "bf16";
    the rows, LR schedule, clip and LoRA initialisation our trainer uses (`batch` rows a
    step from each epoch's seeded permutation; adapters seeded by name). `float8`: every
    nn.Linear of the decoder layers made torchao's Float8Linear (emulated), unsharded."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from enn_cluster.config.schedule import lr_at
    from enn_cluster.models.causal_lm import CausalLM
    from enn_cluster.worker.lm_weights import init_adapters
    from enn_cluster.worker.sampler import epoch_permutation

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
        with torch.no_grad():
            init_adapters(CausalLM(model), seed)  # our names: "lm." + peft's
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=True),
            module_filter_fn=lambda m, fqn: ".layers." in fqn and type(m) is torch.nn.Linear)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()
    per_epoch = len(ids) // batch
    out = []
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        rows = epoch_permutation(len(ids), seed, epoch)[k * batch:(k + 1) * batch]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup_ratio)
        xb = torch.from_numpy(ids[rows]).long()
        yb = xb if labels is None else torch.from_numpy(labels[rows]).long()
        with cast:
            loss = model(input_ids=xb, labels=yb).loss  # the mean over the step's tokens
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


__all__ = ["tiny_model", "copy_model", "packed_tokens", "token_files", "lm_config",
           "write_texts", "corpus", "PRECISIONS", "bf16_training", "checkpoint_dtypes",
           "reference_losses", "chat_model", "with_template", "chats", "oracle_chat",
           "CHAT_TEMPLATES", "unmarked", "stage_text", "prepare_text",
           "assert_refused_before_any_run"]
