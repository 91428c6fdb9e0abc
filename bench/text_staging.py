"""Text staging for causal LMs (`storage.text_staging.stage_text_data`) vs the fast tokenizer's
own batched encode of the same texts, in tokens/s.

Ours reads a parquet file of documents in batches, tokenizes them, lays them out in packed
rows with labels and writes both memmaps durably (checksummed, fsynced, renamed). The
baseline is handed the same texts already in memory as one list and only encodes them: the
fastest batched call the fast tokenizer has (`tokenizers`' `encode_batch_fast`, all cores,
faster here than `encode_batch` and than transformers' batched `__call__`), ids read out
as Python lists. Both sides count the same tokens (the baseline's, EOS not included);
repeats alternate which side goes first.
"""
from __future__ import annotations

import shutil

from .measure import BenchContext, Result, Series, ratios, settle, timed


def run(ctx: BenchContext) -> list[Result]:
    from enn_cluster.client import llm_assets
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.storage.text_sources import load_tokenizer
    from enn_cluster.storage.text_staging import stage_text_data

    docs = 20_000 if ctx.quick else 200_000
    base = ctx.workdir / "text_staging"
    base.mkdir()
    # a model directory (config.json beside the tokenizer): what model.name must name
    llm_assets.write_tiny_model(base / "tok", texts=llm_assets.corpus(2000, seed=1),
                                vocab_size=1024)
    texts = llm_assets.corpus(docs, seed=2)
    train = llm_assets.write_texts(base / "train.parquet", texts)
    cfg = config_from_dict({"model": {"name": f"hf:{base / 'tok'}"},
                            "data": {"train_path": str(train), "max_length": 1024}})
    backend = load_tokenizer(cfg.data, cfg.model)[1].backend_tokenizer
    tokens = sum(len(e.ids) for e in backend.encode_batch_fast(texts))
    ctx.log(f"text_staging: {docs} documents, {tokens} tokens, {ctx.repeats} repeats")
    ours_s, bare_s = [], []
    for i in range(ctx.repeats):
        out = base / f"staged-{i}"
        out.mkdir()

        def ours() -> None:
            ours_s.append(timed(lambda: stage_text_data(cfg.data, cfg.model, out)))

        def bare() -> None:
            bare_s.append(timed(lambda: [e.ids for e in backend.encode_batch_fast(texts)]))

        for fn in ((ours, bare) if i % 2 == 0 else (bare, ours)):
            settle()
            fn()
        shutil.rmtree(out)
    shutil.rmtree(base)
    per_s = lambda secs: [tokens / s for s in secs]  # noqa: E731
    return [Result(
        "text_staging", "text staging (tokenize + pack + memmaps) vs batched encode", ">=", 0.9,
        samples=ratios(bare_s, ours_s),
        ours=Series("stage_text_data: parquet batches, encode_batch_fast on a helper thread, "
                    "packed rows + labels, two checksummed fsynced memmaps", "tokens/s",
                    per_s(ours_s)),
        baseline=Series("tokenizers encode_batch_fast of the texts in memory, ids as lists",
                        "tokens/s", per_s(bare_s)),
        note=f"{docs} documents of 3-60 words, {tokens} tokens, byte-level BPE (1024), "
             "max_length 1024, packing on")]
