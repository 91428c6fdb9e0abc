"""Tiny, local stand-ins for what an LM user brings: a random Llama- or Qwen2-shaped causal LM
saved with `save_pretrained`, a BPE tokenizer trained on a small corpus, and that corpus as
parquet or jsonl. `make demo-llm`, the tests and the benchmarks load them through the real
`from_pretrained` paths; nothing comes from a hub (no network at run time).

Needs the `llm` extra (transformers, tokenizers, pyarrow).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cluster trains a model on shards of data while every node keeps its own "
         "replica of the optimizer state and the scheduler decides which job runs next "
         "checkpoints land on the shared filesystem and a resume reads them back at any "
         "world size the loss goes down as the adapters learn the text").split()

ARCHS = {  # tiny shapes: a few hundred thousand parameters, loaded in well under a second
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=True),
    # learned absolute positions, 32 of them (a row may be no longer); no dropout, so that
    # a run is exact against a plain loop
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=32,
                 attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=True),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=64,
                dropout=0.0, attention_dropout=0.0),
}


def corpus(n_docs: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of varied length (3 to 60 words)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n_docs)]


# Llama-3's pre-tokenizer split (Qwen2's but for digits): a run of newlines is one piece,
# joined with the whitespace before it, as users' tokenizers cut text
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def write_tokenizer(out_dir: Path, texts: list[str], vocab_size: int = 512,
                    reserved: int = 0, chat_specials: tuple = (),
                    chat_template: str | None = None) -> None:
    """A byte-level BPE tokenizer trained on `texts`, saved as a transformers fast tokenizer
    (tokenizer.json + tokenizer_config.json), with <pad>, <s> and </s> (and `chat_specials`,
    e.g. <|im_start|>, with `chat_template`). `reserved` unused special tokens come first,
    so every real id is at least that large: a real vocabulary (128k-151k) has ids far above
    256, the last integer bf16 holds exactly."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [f"<reserved_{i}>" for i in range(reserved)] + ["<pad>", "<s>", "</s>",
                                                                *chat_specials]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + reserved, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # paragraphs too, so that newlines merge as in a real vocabulary ("\n\n" one token)
    tok.train_from_iterator([*texts, *("\n\n".join(texts[i:i + 4]) + "\n"
                                       for i in range(0, len(texts), 4))], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def write_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0,
                     texts: list[str] | None = None, vocab_size: int = 512,
                     dtype: str = "float32", reserved: int = 0, chat_specials: tuple = (),
                     chat_template: str | None = None, **shape_over) -> Path:
    """A random causal LM of the `arch` shape (`shape_over` changes any of it, or gives the
    whole shape of a model_type ARCHS lacks) plus its tokenizer (`vocab_size` tokens after
    `reserved` unused ones) in `out_dir`, saved as
    safetensors by `save_pretrained` in `dtype` (its config.json says so, as every real
    Llama-3 and Qwen2.5 says bfloat16), the tokenizer with `chat_specials` and
    `chat_template` when given; returns `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, texts or corpus(400, seed), vocab_size, reserved, chat_specials,
                    chat_template)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    shape = {**ARCHS.get(arch, {"model_type": arch}), **shape_over}
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=len(tok),
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return out_dir


def write_texts(path: Path, texts: list[str], field: str = "text", **extra_columns) -> Path:
    """`texts` (and any extra columns of the same length) as `.parquet` or `.jsonl`, by the
    path's suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {field: list(texts), **{k: list(v) for k, v in extra_columns.items()}}
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), str(path))
    else:
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
