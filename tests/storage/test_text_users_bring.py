"""Text as users' tokenizers and files give it, at staging: a Llama-2-style tokenizer that
appends EOS to what it encodes (`<s> $A </s>`) staged an EOS between a prompt and its
text, so packed training cut the text off from its prompt, and ended every document with
two; a JSON row holding half a surrogate pair (an emoji cut in two) was a traceback; rows
cut at data.max_length before anything they hold is learned trained on a loss of 0,
silently; tokens added to the model's own tokenizer were blamed on data.tokenizer. On the
users' bf16 model (ids above 4000)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from enn_cluster.client.llm_assets import corpus
from lm_support import assert_refused_before_any_run, prepare_text, tiny_model, write_texts

IGNORE = -100


@pytest.fixture(scope="module")
def users_model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("users-text"), precision="bf16")


def _appending_eos(model_dir, dest):
    """The model's tokenizer, made to add `<s>` before and `</s>` after every text it
    encodes with special tokens (Llama-2's `add_eos_token: true`)."""
    from tokenizers import Tokenizer, processors

    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", bos), ("</s>", eos)])
    tok.save(str(dest / "tokenizer.json"))
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {**config, "add_bos_token": True, "add_eos_token": True}))
    return dest, bos, eos


def _config(tmp_path, model_dir, train, **data) -> dict:
    return {"run_name": "text", "runs_root": str(tmp_path / "runs"),
            "model": {"name": f"hf:{model_dir}"}, "lora": {"r": 0},
            "data": {"train_path": str(train), "max_length": 32, **data},
            "training": {"per_device_train_batch_size": 2}}


@pytest.mark.parametrize("packing", [True, False])
def test_a_tokenizer_that_appends_eos_stages_one_eos_per_document(users_model, tmp_path, packing):
    """Packed prompt/text pairs: each document is BOS, the prompt, the text and one EOS (no
    EOS between prompt and text, which would make them two documents that cannot see each
    other); prompts not learned. Padded plain texts: one EOS each, learned once."""
    from transformers import AutoTokenizer

    tok_dir, bos, eos = _appending_eos(users_model, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert tok("a job").input_ids[-1] == eos  # the tokenizer does append it
    texts, prompts = corpus(30, seed=2), corpus(30, seed=3)
    if packing:
        rows = [{"prompt": p, "text": t} for p, t in zip(prompts, texts)]
        data = {"prompt_field": "prompt", "packing": True}
    else:
        rows, data = [{"text": t} for t in texts[:6]], {"packing": False, "max_length": 160}
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = prepare_text(tmp_path, _config(tmp_path, users_model, train, tokenizer=str(tok_dir),
                                         **data))
    assert res.returncode == 0, res.stderr[-3000:]
    staged = tmp_path / "runs" / "text" / "data"
    x, y = np.load(staged / "train_x.npy"), np.load(staged / "train_y.npy")
    plain = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    if packing:
        stream, learned = [], []
        for p, t in zip(prompts, texts):
            head = [bos] + plain(p)
            stream += head + plain(t) + [eos]
            learned += [False] * len(head) + [True] * (len(plain(t)) + 1)
        assert x.reshape(-1).tolist() == stream[:x.size]
        assert ((y.reshape(-1) != IGNORE) == np.array(learned[:x.size])).all()
    else:
        for row, labels, text in zip(x, y, texts):
            doc = [bos] + plain(text) + [eos]
            assert row[:len(doc)].tolist() == doc and (row == eos).sum() == 1
            assert (labels[len(doc):] == IGNORE).all() and labels[len(doc) - 1] == eos


def test_half_a_surrogate_pair_is_refused_in_one_line(users_model, tmp_path):
    """`"\\ud83d"` is valid JSON but not text: one line naming the row, nothing written; a
    whole pair (an escaped emoji) is text."""
    train = tmp_path / "train.jsonl"
    rows = ['{"text": "the cluster trains a model \\ud83d\\ude00"}',
            '{"text": "an emoji cut \\ud83d in two"}']
    train.write_text("\n".join(rows * 20) + "\n")
    assert_refused_before_any_run(
        prepare_text(tmp_path, _config(tmp_path, users_model, train, max_length=8)), tmp_path,
        [f"data.train_path: {train} line 2 holds a lone UTF-16 surrogate escape", "fix or drop"])
    train.write_text("\n".join(rows[:1] * 40) + "\n")
    res = prepare_text(tmp_path, _config(tmp_path, users_model, train, max_length=8))
    assert res.returncode == 0, res.stderr[-3000:]


def test_rows_cut_before_anything_is_learned_are_refused(users_model, tmp_path):
    """One document per row (packing off) whose prompts fill data.max_length: no token of
    the file would be learned (a run trained on a loss of 0, eval NaN). One line, no run;
    with room for the responses it stages."""
    words = corpus(40, seed=4)
    rows = [{"prompt": " ".join(words[:6]), "text": words[10 + i]} for i in range(8)]
    train = write_texts(tmp_path / "train.jsonl", [r["text"] for r in rows],
                        prompt=[r["prompt"] for r in rows])
    cfg = _config(tmp_path, users_model, train, prompt_field="prompt", packing=False,
                  max_length=24)
    assert_refused_before_any_run(prepare_text(tmp_path, cfg), tmp_path, [
        f"data.max_length: no token of {train} is learned: 8 of its 8 documents are cut at "
        "24 tokens before the part the loss learns"])
    cfg["data"]["max_length"] = 1024
    res = prepare_text(tmp_path, cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    y = np.load(tmp_path / "runs" / "text" / "data" / "train_y.npy")
    assert ((y != IGNORE).sum(axis=1) > 0).all()


def test_tokens_added_to_the_models_own_tokenizer_name_the_fix(users_model, tmp_path):
    """A chat marker added to the tokenizer (past the embedding's vocab_size) but the
    model not resized: the line names the model's own tokenizer and the resize, not
    data.tokenizer, which the user never set."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(users_model, model)
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn|>"]})
    tok.save_pretrained(str(model))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert tok.convert_tokens_to_ids("<|turn|>") >= vocab
    train = write_texts(tmp_path / "train.jsonl", [f"<|turn|> {t}" for t in corpus(30)])
    assert_refused_before_any_run(prepare_text(tmp_path, _config(tmp_path, model, train)),
                                  tmp_path, [
        f"model.name: the model's own tokenizer in {model} gives token id "
        f"{tok.convert_tokens_to_ids('<|turn|>')}, past its vocabulary (vocab_size {vocab}",
        "model.resize_token_embeddings(len(tokenizer))"])
