"""Fine-tuning a causal LM on chat data (`data.messages_field`, issue 36): a tiny random
Llama whose tokenizer carries Qwen2.5's chat template (without `{% generation %}` markers)
is trained through the real CLI on 2 ranks, and every loss equals a plain transformers loop's
on the rows transformers itself makes: `apply_chat_template` ids, labels from its
assistant mask (the same template with markers), packed or one chat per row. The held-out
rows' eval loss is transformers' loss of the trained model over them.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import cli, metrics, write_config
from lm_support import (
    CHAT_TEMPLATES,
    PRECISIONS,
    RESERVED_IDS,
    bf16_training,
    chat_model,
    chats,
    checkpoint_dtypes,
    lm_config,
    oracle_chat,
    reference_losses,
    with_template,
)

pytest.importorskip("transformers")

IGNORE = -100
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}  # as tests/e2e/test_llm_train.py measured
EVAL_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # bf16 forward against an fp32 one
LENGTH = 64


@pytest.fixture(scope="module", params=PRECISIONS)
def model_dir(request, tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat-lm"), precision=request.param)


def oracle_rows(marked, conversations, packing: bool, pad: int):
    """The rows transformers makes of the chats: ids and labels, packed or padded."""
    docs = [oracle_chat(marked, m) for m in conversations]
    labelled = [(ids, [t if k else IGNORE for t, k in zip(ids, mask)]) for ids, mask in docs]
    if packing:
        ids = [t for d, _ in labelled for t in d]
        labels = [t for _, y in labelled for t in y]
        rows = len(ids) // LENGTH
        shape = (rows, LENGTH)
        return (np.array(ids[:rows * LENGTH]).reshape(shape),
                np.array(labels[:rows * LENGTH]).reshape(shape))
    x = np.full((len(docs), LENGTH), pad)
    y = np.full((len(docs), LENGTH), IGNORE)
    for row, (ids, labels) in enumerate(labelled):
        x[row, :len(ids[:LENGTH])], y[row, :len(labels[:LENGTH])] = ids[:LENGTH], labels[:LENGTH]
    return x, y


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_chat_losses_follow_a_plain_transformers_loop(model_dir, tmp_path, packing):
    """6 steps on 2 ranks, 8 rows a step, a full fine-tune: the staged rows are
    transformers' own, every loss equals the plain loop's on them, the eval loss over the
    held-out rows is the trained model's, and the checkpoint is fp32 whatever the weights'
    dtype (a bf16 model: ids above 4000)."""
    import torch
    from transformers import AutoTokenizer

    precision = "bf16" if str(model_dir).endswith("-bf16") else "fp32"
    conversations = chats(48, seed=3)
    train = tmp_path / "chat.jsonl"
    import json

    train.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    cfg = lm_config(tmp_path, model_dir, "chat", lora={"r": 0},
                    data={"train_path": str(train), "train_targets_path": None,
                          "messages_field": "messages", "max_length": LENGTH,
                          "packing": packing, "eval_fraction": 0.25},
                    training={"max_steps": 6, "per_device_train_batch_size": 4,
                              **bf16_training(precision)},
                    checkpoint={"every_steps": 6})
    res = cli("train", "--config", write_config(tmp_path / "run.yaml", **cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "chat"

    marked = with_template(model_dir, tmp_path / "marked", CHAT_TEMPLATES["qwen2.5"])
    pad = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True).pad_token_id
    x, y = oracle_rows(marked, conversations, packing, pad)
    assert np.array_equal(np.load(run / "data" / "train_x.npy"), x)
    assert np.array_equal(np.load(run / "data" / "train_y.npy"), y)
    if precision == "bf16":
        assert x[y != IGNORE].min() > RESERVED_IDS
    held = len(x) - int(len(x) * 0.25)
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    assert manifest["train_rows"] == [0, held] and manifest["eval_rows"] == [held, len(x)]

    ours = [r["loss"] for r in metrics(run, "train")]
    t = cfg["training"]
    theirs = reference_losses(model_dir, x[:held], 6, 8, t["lr"], t["warmup_ratio"],
                              t["seed"], precision=precision, labels=y[:held])
    assert len(ours) == 6
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert math.isclose(a, b, rel_tol=LOSS_TOLERANCE[precision]), (step, ours, theirs)

    import enn_cluster

    model = enn_cluster.Run.open(run).load_model(6)
    with torch.no_grad():
        logits = model(torch.from_numpy(x[held:]).long()).float()
    labels = torch.from_numpy(y[held:]).long()
    expect = float(torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
        ignore_index=IGNORE))
    last = metrics(run, "eval")[-1]
    assert last["step"] == 6
    assert math.isclose(last["eval_loss"], expect, rel_tol=EVAL_TOLERANCE[precision]), \
        (last, expect)
    dtypes = checkpoint_dtypes(run / "checkpoints" / "step-6")
    assert set(dtypes.values()) == {"float32"}, dtypes
    if packing:
        assert_chat_predictions(tmp_path, run, model, conversations[:3], precision)


def assert_chat_predictions(tmp_path, run, model, conversations, precision) -> None:
    """`predict --input` of chat rows that end with a user turn scores each rendered with
    the generation prompt: its token count and mean log-likelihood are the trained model's
    on `apply_chat_template(..., add_generation_prompt=True)`."""
    import json

    import torch
    from transformers import AutoTokenizer

    asks = [m[:-1] for m in conversations]
    source = tmp_path / "asks.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in asks))
    res = cli("predict", run, "--input", source, "--name", "asks", "--nodes", 1,
              "--procs-per-node", 1, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("collect", run, "--name", "asks", "--out", tmp_path / "asks.npy")
    assert res.returncode == 0, res.stderr[-3000:]
    scores = np.load(tmp_path / "asks.npy")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "marked"), local_files_only=True)
    for row, messages in enumerate(asks):
        ids = list(tok.apply_chat_template(messages, tokenize=True,
                                           add_generation_prompt=True)["input_ids"])[:LENGTH]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).float()[0, :-1], -1)
        mean = float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean())
        assert scores[row, 1] == len(ids) - 1, (row, scores[row])
        assert math.isclose(scores[row, 0], mean, rel_tol=EVAL_TOLERANCE[precision]), \
            (row, scores[row], mean)
