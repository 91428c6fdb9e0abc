"""Packed documents do not see each other (issue 36 section 4, "Packing without cross-talk").

Text staged with `data.packing: true` runs many documents on in one row, each ended by EOS.
In training, a document's tokens attend only to its own and its positions count from 0
(transformers' packed-sequence mask, read from positions that restart), and its first token
is not learned from the previous document's EOS. The oracle is transformers' own loss of
each document run alone; the same rows with documents that see each other must differ, so
the test can fail. On a tiny model of every architecture packed text is allowed for, saved
in fp32 and in bf16 (ids above 4000); the others refuse packed text in one line.
"""
from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch

from enn_cluster.client import llm_assets
from enn_cluster.models.causal_lm import PACKS_DOCUMENTS, CausalLM
from enn_cluster.models.lm_loss import IGNORE_INDEX, packed_positions
from enn_cluster.worker.sampler import epoch_permutation
from helpers import cli, metrics, write_config
from lm_support import (PRECISIONS, assert_refused_before_any_run, bf16_training, prepare_text,
                        tiny_model)

# a packed row against its documents alone, on the same weights (measured: 1.3e-7 fp32,
# 1.8e-6 bf16 relative); documents that see each other differ by 6e-4 to 5e-3
TOLERANCE = {"fp32": 1e-6, "bf16": 2e-5}
# the run (FSDP, bf16 parameters in compute) against a reference in bf16 autocast: as
# tests/e2e/test_llm_train.py measured, bf16 agrees to bf16 round-off only
RUN_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}
# Granite-3's multipliers (logits / 8, attention x 1/16, residual x 0.22) leave a tiny random
# model's logits near-uniform whatever the context: its head is test_lm_loss's, its
# attention is tested here at Granite's defaults (1.0)
PACKING_SHAPES = {"granite": {"logits_scaling": 1.0, "embedding_multiplier": 1.0,
                              "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                              "initializer_range": 0.02}}


def test_positions_restart_after_each_document_end():
    ids = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 4], [2, 3, 3, 3, 3, 2, 2, 1]])
    assert packed_positions(ids, 2).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],
                                                 [0, 0, 1, 2, 3, 4, 0, 0]]
    assert packed_positions(ids, 99).tolist() == [list(range(8))] * 2  # one sequence a row


def _lone_losses(lm, docs: list[torch.Tensor]) -> tuple[float, int]:
    """transformers' own loss of each document alone, summed over its learned tokens."""
    total, count = 0.0, 0
    for doc in docs:
        if len(doc) < 2:
            continue
        loss = lm(input_ids=doc[None], labels=doc[None]).loss.double().item()
        total, count = total + loss * (len(doc) - 1), count + len(doc) - 1
    return total, count


def _documents(row: list[int], eos: int) -> list[torch.Tensor]:
    docs, cur = [], []
    for t in row:
        cur.append(t)
        if t == eos:
            docs.append(torch.tensor(cur))
            cur = []
    return docs + ([torch.tensor(cur)] if cur else [])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", sorted(PACKS_DOCUMENTS))
def test_a_packed_row_loses_what_its_documents_lose_alone(tmp_path, arch, precision):
    """Every architecture packed text is allowed for (PACKS_DOCUMENTS). That the check can
    fail (documents that see each other lose otherwise) is shown in fp32: a tiny random
    model's cross-talk can lie within bf16's round-off."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(tmp_path, arch, precision, **PACKING_SHAPES.get(arch, {}))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    eos = int(lm.config.eos_token_id)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for lengths in ([7, 11, 9], [4, 20, 5], [31]):  # the last document of a row runs on
        row = []
        for n in lengths:
            doc = torch.randint(vocab - 200, vocab, (n,), generator=gen)
            doc = doc[doc != eos]
            row += doc.tolist() + [eos]
        rows.append(row[:24])
    ids = torch.tensor(rows)
    labels = ids.clone()
    starts = packed_positions(ids, eos) == 0
    labels[starts] = IGNORE_INDEX  # as staging writes them: a document's first token
    model = CausalLM(lm, document_end=eos)
    with torch.no_grad():
        packed = model(ids, labels=labels).double().item()
        total, count = 0.0, 0
        for row in rows:
            t, c = _lone_losses(lm, _documents(row, eos))
            total, count = total + t, count + c
        assert count == int(CausalLM.learned_tokens(labels))
        alone = total / count
        model.document_end = None  # the same rows, the documents seeing each other
        crossed = model(ids, labels=labels).double().item()
    tol = TOLERANCE[precision]
    assert math.isclose(packed, alone, rel_tol=tol), (packed, alone)
    if precision == "fp32":
        assert not math.isclose(crossed, alone, rel_tol=10 * tol), (crossed, alone)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_on_packed_text_keeps_documents_apart(tmp_path, precision):
    """Through the CLI on 2 ranks: the first step's loss (before any update) over its four
    staged rows equals transformers' loss of each document piece alone."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(tmp_path, "qwen2", precision)
    train = llm_assets.write_texts(tmp_path / "train.jsonl", llm_assets.corpus(40, seed=4))
    cfg = {"run_name": "packed", "runs_root": str(tmp_path / "runs"),
           "model": {"name": f"hf:{model_dir}"}, "lora": {"r": 0},
           "data": {"train_path": str(train), "max_length": 48, "packing": True,
                    "eval_fraction": 0.0},
           "training": {"max_steps": 1, "per_device_train_batch_size": 2, "lr": 1e-3,
                        "seed": 3, **bf16_training(precision)},
           "checkpoint": {"every_steps": 0},
           "parallel": {"nodes": 1, "procs_per_node": 2}}
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "packed"
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    x = np.load(run / "data" / "train_x.npy")
    y = np.load(run / "data" / "train_y.npy")
    assert manifest["text"]["packing"] and manifest["text"]["documents"] == 40
    rows = epoch_permutation(len(x), 3, 0)[:4]  # the first step's rows (2 ranks x 2)
    x, y = x[rows], y[rows]
    eos = manifest["text"]["eos_token_id"]
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()  # fp32 master weights, bf16 compute: as the run
    total, count = 0.0, 0
    with torch.no_grad(), cast:
        for row, lab in zip(x.tolist(), y.tolist()):
            assert lab[0] == IGNORE_INDEX or row[0] == lab[0]
            t, c = _lone_losses(lm, _documents(row, eos))
            total, count = total + t, count + c
        crossed = lm(input_ids=torch.from_numpy(x).long(),
                     labels=torch.from_numpy(y).long()).loss.item()
    assert count == int((y[:, 1:] != IGNORE_INDEX).sum())
    first, tol = metrics(run, "train")[0]["loss"], RUN_TOLERANCE[precision]
    assert math.isclose(first, total / count, rel_tol=tol), (first, total / count)
    if precision == "fp32":  # the run did keep the documents apart
        assert not math.isclose(first, crossed, rel_tol=10 * tol), (first, crossed)


@pytest.mark.parametrize("arch", ["bloom", "opt"])
def test_packed_text_is_refused_for_a_model_that_cannot_keep_documents_apart(tmp_path, arch):
    """Bloom's ALiBi takes no positions; OPT builds its mask without them: a packed row's
    documents would see each other (as the forward shows), so `prepare` refuses packed text
    in one line, writing nothing, and takes one document per row."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(tmp_path, arch, "bf16")
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos, vocab = int(lm.config.eos_token_id), lm.config.vocab_size
    a = torch.randint(vocab - 200, vocab, (1, 9), generator=torch.Generator().manual_seed(2))
    b = torch.randint(vocab - 200, vocab, (1, 9), generator=torch.Generator().manual_seed(3))
    a[0, -1] = eos
    with torch.no_grad():  # the second document's logits change with the first before it
        packed = CausalLM(lm, document_end=eos).lm(
            input_ids=torch.cat([a, b], 1), position_ids=packed_positions(torch.cat([a, b], 1),
                                                                          eos)).logits[0, 9:]
        alone = lm(input_ids=b).logits[0]
    assert (packed - alone).abs().max() > 1e-3
    train = llm_assets.write_texts(tmp_path / "train.jsonl", llm_assets.corpus(40, seed=4))
    cfg = {"run_name": "packed", "runs_root": str(tmp_path / "runs"),
           "model": {"name": f"hf:{model_dir}"}, "lora": {"r": 0},
           "data": {"train_path": str(train), "max_length": 32, "packing": True}}
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        f"data.packing: a {arch} model does not keep packed documents apart",
        "set data.packing: false"])
    cfg["data"]["packing"] = False
    res = prepare_text(tmp_path, cfg)
    assert res.returncode == 0, res.stderr[-3000:]


def test_only_packed_plain_text_is_split_at_its_eos():
    """A chat template may end every turn with EOS (Qwen2.5's <|im_end|>, Llama-3's
    <|eot_id|>): a turn must still see the ones before it, so chats are not split; nor are
    token arrays a user gives (no text section), nor rows of one padded document each."""
    from torch import nn

    from enn_cluster.models.causal_lm import CAUSAL_LM

    def bound(manifest):
        model = CausalLM(nn.Identity())
        CAUSAL_LM.bind_data(model, manifest)
        return model.document_end

    text = {"packing": True, "eos_token_id": 7}
    assert bound({"text": text}) == 7
    assert bound({"text": {**text, "messages_field": "messages"}}) is None
    assert bound({"text": {**text, "packing": False}}) is None
    assert bound({}) is None
    from enn_cluster.errors import UserError  # a forged manifest: one line, not a traceback

    for forged in ("7", 7.5, True, -1, [7]):
        with pytest.raises(UserError, match="text.eos_token_id"):
            bound({"text": {**text, "eos_token_id": forged}})


@pytest.mark.parametrize("precision", PRECISIONS)
def test_packed_text_paused_at_world_2_resumed_at_1_matches_the_uninterrupted_run(tmp_path,
                                                                                  precision):
    """The documents stay apart after a resume at another world size: every step's LR and
    loss as the uninterrupted run's, the checkpoint's trained tensors fp32."""
    from lm_support import checkpoint_dtypes

    model_dir = tiny_model(tmp_path, "qwen2", precision)
    train = llm_assets.write_texts(tmp_path / "train.jsonl", llm_assets.corpus(40, seed=4))

    def config(name, **training):
        return {"run_name": name, "runs_root": str(tmp_path / "runs"),
                "model": {"name": f"hf:{model_dir}"}, "lora": {"r": 0},
                "data": {"train_path": str(train), "max_length": 48, "eval_fraction": 0.0},
                "training": {"max_steps": 4, "per_device_train_batch_size": 2,
                             "global_batch_size": 4, "lr": 1e-3, "seed": 3,
                             **bf16_training(precision), **training},
                "checkpoint": {"every_steps": 2},
                "parallel": {"nodes": 1, "procs_per_node": 2}}

    for name, extra in (("through", {}), ("moved", {"pause_at_step": 2})):
        path = write_config(tmp_path / f"{name}.yaml", **config(name, **extra))
        res = cli("train", "--config", path)
        assert res.returncode == 0, res.stderr[-3000:]
    moved = tmp_path / "runs" / "moved"
    res = cli("resume", moved, "--procs-per-node", 1)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = {r["step"]: r for r in metrics(moved, "train")}
    theirs = {r["step"]: r for r in metrics(tmp_path / "runs" / "through", "train")}
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    assert metrics(moved, "resume")[-1]["world_size"] == 1
    for step in theirs:
        assert ours[step]["lr"] == theirs[step]["lr"], step
        assert math.isclose(ours[step]["loss"], theirs[step]["loss"],
                            rel_tol=RUN_TOLERANCE[precision]), (step, ours, theirs)
    dtypes = checkpoint_dtypes(moved / "checkpoints" / "step-4")
    assert {d for n, d in dtypes.items() if n.startswith("model.")} == {"float32"}, dtypes
