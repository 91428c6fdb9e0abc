"""Chat data for causal LMs (`data.messages_field`): staged ids are the tokenizer's own
`apply_chat_template`, and the learned tokens are transformers' own assistant mask (from the
same template with `{% generation %}` markers), while staging renders the unmarked template
real models ship (Qwen2.5, Llama-3). Bad rows and templates are refused in one line before
any run directory exists."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from enn_cluster.config.loading import config_from_dict  # noqa: E402
from enn_cluster.errors import UserError  # noqa: E402
from enn_cluster.storage import text_staging  # noqa: E402
from enn_cluster.storage.chat_tokens import assistant_mask  # noqa: E402
from enn_cluster.storage.text_staging import IGNORE, text_rows  # noqa: E402
from helpers import ROOT  # noqa: E402
from lm_support import (  # noqa: E402
    CHAT_TEMPLATES,
    PRECISIONS,
    RESERVED_IDS,
    chat_model,
    chats,
    oracle_chat,
    unmarked,
    with_template,
)
from lm_support import assert_refused_before_any_run  # noqa: E402
from lm_support import prepare_text as prepare, stage_text as stage  # noqa: E402

CHATS = chats(40, seed=7)


@pytest.fixture(scope="module", params=PRECISIONS)
def model_dir(request, tmp_path_factory) -> Path:
    """fp32, and the users' world: weights in bf16, every token id above 4000."""
    return chat_model(tmp_path_factory.mktemp("chat"), precision=request.param)


@pytest.fixture(scope="module")
def users_model_dir(tmp_path_factory) -> Path:
    """The users' world alone, for refusals (made before any weight is read)."""
    return chat_model(tmp_path_factory.mktemp("chat-users"), precision="bf16")


def write_chats(path: Path, rows: list, field: str = "messages") -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({field: rows}), str(path))
    else:
        path.write_text("".join(json.dumps({field: r}) + "\n" for r in rows))
    return path


def chat_config(tmp_path, model_dir, train, **data) -> dict:
    return {"run_name": "chat", "runs_root": str(tmp_path / "runs"),
            "model": {"name": f"hf:{model_dir}"},
            "data": {"train_path": str(train), "messages_field": "messages",
                     "max_length": 64, **data},
            "training": {"per_device_train_batch_size": 2}}


def templates(tmp_path, model_dir, name) -> tuple[Path, Path]:
    """(tokenizer with the template as real models ship it, the same with markers)."""
    return (with_template(model_dir, tmp_path / f"{name}-plain", unmarked(CHAT_TEMPLATES[name])),
            with_template(model_dir, tmp_path / f"{name}-marked", CHAT_TEMPLATES[name]))


# ---------------------------------------------------------------------------------------
# The mask, pure


def test_assistant_mask_by_hand():
    specials = frozenset({9})
    full = [1, 2, 3, 4, 9, 5, 6, 7, 9, 5]
    # turn 1: rendered up to it [1, 2], through it [1, 2, 3, 4, 9, 5]: learned 3, 4, 9 (the
    # template's 5 after its end-of-turn 9 is not); turn 2: no special, learned to its end
    mask = assistant_mask(full, [([1, 2], full[:6], True), (full[:7], full[:8], True)],
                          specials)
    assert mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 0, 0]
    assert assistant_mask(full, [([1, 3], full[:6], False)], specials) is None  # not a prefix
    assert assistant_mask(full, [([7, 2], full[:6], True)], specials) is None
    assert assistant_mask(full, [([1, 2], [1, 2, 4], True)], specials) is None
    # an end token (where the model's generate stops) ends the turn before a later special
    # the template writes (Phi-3's EOS after <|end|>), so the whole need not hold that one
    ends = frozenset({4})
    mask = assistant_mask(full, [([1, 2], [1, 2, 3, 4, 9, 8], True)], specials, ends)
    assert mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    # the generation prompt's last token merged with the turn's first characters: learned
    # from that token, when the text says it starts the turn
    merged = [1, 20, 3, 4, 9]
    assert assistant_mask(merged, [([1, 2], merged, True)], specials).tolist() == \
        [0, 1, 1, 1, 1]
    assert assistant_mask(merged, [([1, 2], merged, False)], specials) is None


# ---------------------------------------------------------------------------------------
# Staged tokens against transformers' own rendering and assistant mask


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_packed_chats_are_the_templates_tokens_with_the_assistant_turns_learned(
        tmp_path, model_dir, name, suffix, monkeypatch):
    monkeypatch.setattr(text_staging, "BATCH_DOCS", 7)  # many batches, each encoded ahead
    plain, marked = templates(tmp_path, model_dir, name)
    train = write_chats(tmp_path / f"train{suffix}", CHATS)
    manifest, out = stage(tmp_path, chat_config(tmp_path, model_dir, train,
                                                tokenizer=str(plain)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(plain), local_files_only=True)
    stream, learned = [], []
    for messages in CHATS:
        ids, mask = oracle_chat(marked, messages)
        assert ids == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
        assert any(mask) and not all(mask)
        stream += ids
        learned += mask
    if "bf16" in str(model_dir):
        assert min(stream) > RESERVED_IDS
    rows = len(stream) // 64
    x, y = np.load(out / "train_x.npy"), np.load(out / "train_y.npy")
    assert x.shape == (rows, 64) and x.reshape(-1).tolist() == stream[:rows * 64]
    want = [t if m else IGNORE for t, m in zip(stream, learned)][:rows * 64]
    assert y.reshape(-1).tolist() == want
    text = manifest["text"]
    assert text["messages_field"] == "messages" and text["documents"] == len(CHATS)
    # the markers are neither needed nor in the way
    (tmp_path / "again").mkdir()
    _, again = stage(tmp_path / "again", chat_config(tmp_path, model_dir, train,
                                                     tokenizer=str(marked)))
    assert np.array_equal(np.load(again / "train_y.npy"), y)


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_padded_chats_one_per_row_in_train_and_eval(tmp_path, model_dir, name):
    plain, marked = templates(tmp_path, model_dir, name)
    train = write_chats(tmp_path / "train.jsonl", CHATS)
    evals = write_chats(tmp_path / "eval.parquet", CHATS[:9])
    manifest, out = stage(tmp_path, chat_config(tmp_path, model_dir, train, packing=False,
                                                eval_path=str(evals), tokenizer=str(plain)))
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(plain), local_files_only=True).pad_token_id
    for split, rows in (("train", CHATS), ("eval", CHATS[:9])):
        x, y = np.load(out / f"{split}_x.npy"), np.load(out / f"{split}_y.npy")
        assert x.shape == (len(rows), 64)
        truncated = 0
        for row, messages in enumerate(rows):
            ids, mask = oracle_chat(marked, messages)
            truncated += len(ids) > 64
            kept = ids[:64]
            labels = [t if m else IGNORE for t, m in zip(ids, mask)][:64]
            assert x[row].tolist() == kept + [pad] * (64 - len(kept)), (split, row)
            assert y[row].tolist() == labels + [IGNORE] * (64 - len(kept)), (split, row)
        counts = manifest["text"] if split == "train" else manifest["text"]["eval"]
        assert counts["truncated_documents"] == truncated > 0


def test_predict_rows_end_with_the_generation_prompt(tmp_path, users_model_dir):
    """Prediction input: a chat that ends with a user turn gets the generation prompt (what
    the model answers next); one that ends with an assistant turn is scored as it stands."""
    from transformers import AutoTokenizer

    asks = [m[:-1] for m in CHATS[:5]] + CHATS[5:8]
    source = write_chats(tmp_path / "ask.jsonl", asks)
    cfg = config_from_dict(chat_config(tmp_path, users_model_dir, source, max_length=512))
    rows = text_rows("--input", str(source), cfg.data, cfg.model)
    tok = AutoTokenizer.from_pretrained(str(users_model_dir), local_files_only=True)
    for row, messages in zip(rows, asks):
        want = tok.apply_chat_template(messages, tokenize=True,
                                       add_generation_prompt=messages[-1]["role"] == "user")
        ids = list(want["input_ids"])
        assert row.tolist() == ids + [-1] * (512 - len(ids))


# ---------------------------------------------------------------------------------------
# Refusals: one line naming the file, row and field, exit 2, no run directory


GOOD = CHATS[:3]
OTHER_START = (  # its generation prompt starts a turn otherwise than it renders one: no
    # span of an assistant turn can be trusted, whole or turn by turn
    "{% for m in messages %}<|im_start|>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BAD = {  # name: (rows or a writer, extra data keys, what the one line says)
    "missing field": (lambda t: write_chats(t / "c.jsonl", GOOD, field="chat"), {},
                      ["data.messages_field:", "c.jsonl line 1 has no key 'messages'",
                       "its keys: chat"]),
    "not a list": (GOOD + ["hello"], {},
                   ["c.jsonl line 4: 'messages' holds str, not a list of messages"]),
    "unknown role": (GOOD + [[{"role": "bot", "content": "hi"}]], {},
                     ["c.jsonl line 4: 'messages' message 1 has role 'bot'",
                      "system, user, assistant"]),
    "non-text content": (GOOD + [[{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": 7}]], {},
                         ["c.jsonl line 4: 'messages' message 2's content holds int, not text"]),
    "no assistant turn": (GOOD + [[{"role": "user", "content": "a"}]], {},
                          ["c.jsonl line 4: 'messages' has no assistant message"]),
    "a message without content": (GOOD + [[{"role": "user"}]], {},
                                  ['message 1 is not an object with "role" and "content"']),
    "empty list": ([[]], {}, ["c.jsonl line 1: 'messages' is an empty list"]),
    "an assistant turn first": (GOOD + [[{"role": "assistant", "content": "a"},
                                         {"role": "user", "content": "b"}]], {},
                                ["c.jsonl line 4: 'messages' starts with an assistant message"]),
    "null parquet row": (lambda t: write_chats(t / "c.parquet", GOOD + [None]), {},
                         ["c.parquet row 3: 'messages' is missing (null)"]),
    "parquet column of text": (
        lambda t: write_chats(t / "c.parquet", ["a", "b"]), {},
        ["data.messages_field: column 'messages' of", "holds string, not a list of messages"]),
    "no chat template": (GOOD, {"tokenizer": None},
                         ["data.messages_field: the tokenizer in", "has no chat_template",
                          "set data.tokenizer"]),
    "a generation prompt that starts no turn": (
        GOOD, {"tokenizer": OTHER_START},
        ["c.jsonl line 1: the chat template in", "renders the conversation up to assistant "
         "turn 1 with the generation prompt as other than the start", "cannot be told apart"]),
    "a template that refuses the row": (
        GOOD, {"tokenizer": "{{ raise_exception('roles must alternate') }}"},
        ["c.jsonl line 1: the chat template in", "refuses the conversation",
         "roles must alternate"]),
    "with a prompt field": (GOOD, {"prompt_field": "p"},
                            ["data.messages_field: 'messages' is set with data.prompt_field "
                             "'p'", "remove data.prompt_field"]),
    "with a text field": (GOOD, {"text_field": "body"},
                          ["is set with data.text_field 'body'", "remove data.text_field"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_chat_input_is_one_line_exit_2_and_no_run(tmp_path, users_model_dir, case):
    rows, extra, needles = BAD[case]
    source = rows(tmp_path) if callable(rows) else write_chats(tmp_path / "c.jsonl", rows)
    if "tokenizer" in extra:
        extra = dict(extra, tokenizer=str(with_template(users_model_dir, tmp_path / "tok",
                                                        extra["tokenizer"])))
    res = prepare(tmp_path, chat_config(tmp_path, users_model_dir, source, **extra))
    assert_refused_before_any_run(res, tmp_path, needles)


def test_messages_field_beside_prompt_field_is_refused_by_the_config():
    with pytest.raises(UserError, match="remove data.prompt_field"):
        config_from_dict({"data": {"messages_field": "m", "prompt_field": "p"}})


# ---------------------------------------------------------------------------------------
# docs/quickstart.md's chat example, staged as written


def test_the_documented_chat_example_stages(tmp_path, users_model_dir):
    """The quickstart's chat row and data section, as written: the row stages, and its
    assistant turn (and only it) is learned."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    (row,) = re.findall(r"```json\n(\{\"messages\".*?)\n```", text, re.S)
    (section,) = re.findall(r"```yaml\n(data:\n  messages_field.*?)```", text, re.S)
    import yaml

    data = yaml.safe_load(section)["data"]
    train = tmp_path / "chat.jsonl"
    train.write_text((row.replace("\n", " ") + "\n") * 8)
    data.update(train_path=str(train), eval_path=None)
    cfg = chat_config(tmp_path, users_model_dir, train)
    cfg["data"] = {**data, "max_length": 64}
    _, out = stage(tmp_path, cfg)
    messages = json.loads(row)["messages"]
    ids, mask = oracle_chat(with_template(users_model_dir, tmp_path / "marked",
                                          CHAT_TEMPLATES["qwen2.5"]), messages)
    y = np.load(out / "train_y.npy").reshape(-1)
    want = [t if m else IGNORE for t, m in zip(ids, mask)] * 8
    assert y.tolist() == want[:len(y)] and (y != IGNORE).any()


REASONING_TEMPLATE = (  # Qwen3's way with a turn's reasoning, without its other branches
    r"""{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"""
    r"""{%- if message.role == 'assistant' %}{% generation %}"""
    r"""{%- if message.reasoning_content %}"""
    r"""{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}"""
    r"""{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"""
    r"""{%- else %}{{- message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"""
    r"""{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}""")


def test_a_key_the_template_reads_besides_role_and_content_is_staged(tmp_path, users_model_dir):
    """Qwen3's `reasoning_content`: the template renders it inside <think> and the turn's
    reasoning is learned, as transformers renders and masks it (it was dropped, silently:
    the model was taught to answer without reasoning)."""
    plain = with_template(users_model_dir, tmp_path / "plain", unmarked(REASONING_TEMPLATE))
    marked = with_template(users_model_dir, tmp_path / "marked", REASONING_TEMPLATE)
    rows = [[{"role": "user", "content": c[0]["content"]},
             {"role": "assistant", "content": c[-1]["content"],
              "reasoning_content": f"the scheduler weighs job {i} first"}]
            for i, c in enumerate(CHATS[:8])]
    train = write_chats(tmp_path / "train.jsonl", rows)
    _, out = stage(tmp_path, chat_config(tmp_path, users_model_dir, train, packing=False,
                                         max_length=512, tokenizer=str(plain)))
    x, y = np.load(out / "train_x.npy"), np.load(out / "train_y.npy")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(plain), local_files_only=True)
    for row, messages in enumerate(rows):
        ids, mask = oracle_chat(marked, messages)
        assert x[row, :len(ids)].tolist() == ids, row
        assert y[row, :len(ids)].tolist() == [t if m else IGNORE for t, m in zip(ids, mask)]
        learned = tok.decode([t for t in y[row] if t != IGNORE])
        assert f"weighs job {row} first" in learned, learned


# ---------------------------------------------------------------------------------------
# Templates that render earlier turns otherwise once a later one exists: one document per
# assistant turn


QWEN3_TEMPLATE = (  # Qwen3's way with reasoning, without tools: a <think> block on the turns
    # after the last user turn (always on the last one), none on earlier turns
    r"""{%- set ns = namespace(last_query=-1) %}{%- for message in messages %}"""
    r"""{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"""
    r"""{%- endfor %}{%- for message in messages %}{%- if message.role == 'assistant' %}"""
    r"""{{- '<|im_start|>assistant\n' }}{% generation %}"""
    r"""{%- set reasoning = message.reasoning_content if message.reasoning_content is defined"""
    r""" and message.reasoning_content is not none else '' %}"""
    r"""{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"""
    r"""{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}{%- endif %}"""
    r"""{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"""
    r"""{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"""
    r"""{%- endif %}{%- endfor %}"""
    r"""{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}""")


def last_turn(mask: list) -> list:
    """The mask with only its last learned span kept."""
    start = max(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
    return [m and i >= start for i, m in enumerate(mask)]


def reasoning_chats() -> list:
    """CHATS, every assistant turn of every other one with its reasoning."""
    return [[dict(m, reasoning_content=f"thought {i} {j}") if m["role"] == "assistant"
             and i % 2 == 0 else m for j, m in enumerate(messages)]
            for i, messages in enumerate(CHATS)]


@pytest.mark.parametrize("packing", [True, False])
def test_a_template_that_drops_earlier_reasoning_learns_each_turn_as_it_is_answered(
        tmp_path, model_dir, packing, monkeypatch):
    """Qwen3 drops an assistant turn's reasoning once a user turn follows it, so the whole
    conversation holds no span of what the model wrote at that turn (it was refused). Each
    assistant turn is staged as the conversation through it, with only it learned, as
    transformers renders and masks it: what the model answers that turn from at inference,
    and the turn's reasoning with it."""
    monkeypatch.setattr(text_staging, "BATCH_DOCS", 7)
    plain = with_template(model_dir, tmp_path / "plain", unmarked(QWEN3_TEMPLATE))
    marked = with_template(model_dir, tmp_path / "marked", QWEN3_TEMPLATE)
    rows = reasoning_chats()
    train = write_chats(tmp_path / "train.jsonl", rows)
    width = 64 if packing else 512
    manifest, out = stage(tmp_path, chat_config(tmp_path, model_dir, train, packing=packing,
                                                max_length=width, tokenizer=str(plain)))
    docs = []
    for messages in rows:
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                ids, mask = oracle_chat(marked, messages[:i + 1])
                docs.append((ids, last_turn(mask)))
    if "bf16" in str(model_dir):
        assert min(min(ids) for ids, _ in docs) > RESERVED_IDS
    x, y = np.load(out / "train_x.npy"), np.load(out / "train_y.npy")
    if packing:
        stream = [t for ids, _ in docs for t in ids]
        labels = [t if m else IGNORE for ids, mask in docs for t, m in zip(ids, mask)]
        assert x.reshape(-1).tolist() == stream[:x.size]
        assert y.reshape(-1).tolist() == labels[:y.size]
    else:
        assert x.shape[0] == len(docs)
        for row, (ids, mask) in enumerate(docs):
            assert x[row, :len(ids)].tolist() == ids, row
            assert y[row].tolist() == [t if m else IGNORE for t, m in zip(ids, mask)] + \
                [IGNORE] * (width - len(ids)), row
    multi = sum(sum(m["role"] == "assistant" for m in c) > 1 for c in rows)
    text = manifest["text"]
    assert text["documents"] == len(docs) and text["per_turn_conversations"] == multi > 0
    if not packing:  # each turn learns its own reasoning, which no later rendering holds
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(plain), local_files_only=True)
        turn = iter((i, j) for i, c in enumerate(rows) for j, m in enumerate(c)
                    if m["role"] == "assistant")
        for row in range(len(docs)):
            i, j = next(turn)
            learned = tok.decode([t for t in y[row] if t != IGNORE])
            assert ("thought %d %d" % (i, j) in learned) == (i % 2 == 0), (row, learned)


# ---------------------------------------------------------------------------------------
# Where a turn starts and ends in the tokens users' tokenizers and templates make


def test_a_reply_that_starts_with_a_newline_is_learned_as_transformers_marks_it(
        tmp_path, model_dir):
    """Qwen2.5's template writes a newline after the role header; a reply that starts with
    one merges with it into one token ("\n\n": Qwen2's and Llama-3's split), so the rendering
    up to the turn is no token prefix of the rendering through it. Such a row was refused,
    and the whole file with it; now the merged token starts the learned span, as
    transformers' assistant mask marks it."""
    plain, marked = templates(tmp_path, model_dir, "qwen2.5")
    rows = [[dict(m, content=("\n" * (1 + i % 2)) + m["content"]) if m["role"] == "assistant"
             else m for m in messages] for i, messages in enumerate(CHATS[:12])]
    train = write_chats(tmp_path / "train.jsonl", rows)
    manifest, out = stage(tmp_path, chat_config(tmp_path, model_dir, train, packing=False,
                                                max_length=512, tokenizer=str(plain)))
    x, y = np.load(out / "train_x.npy"), np.load(out / "train_y.npy")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(plain), local_files_only=True)
    (merged,) = tok.encode("\n\n", add_special_tokens=False)  # one token, as users' vocabularies
    assert x.shape[0] == len(rows) and manifest["text"]["per_turn_conversations"] == 0
    for row, messages in enumerate(rows):
        ids, mask = oracle_chat(marked, messages)
        assert x[row, :len(ids)].tolist() == ids, row
        assert y[row, :len(ids)].tolist() == [t if m else IGNORE for t, m in zip(ids, mask)]
    assert merged in y[1]  # the header's newline and the reply's, learned as one token


PHI3_TEMPLATE = (  # Phi-3-mini's: <|end|> ends each turn; EOS after the last, unless prompted
    r"""{% for message in messages %}{% if message['role'] == 'assistant' %}"""
    r"""{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + '<|end|>' }}"""
    r"""{% endgeneration %}{{ '\n' }}{% else %}"""
    r"""{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}"""
    r"""{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"""
    r"""{% else %}{{ eos_token }}{% endif %}""")


def with_end_tokens(model_dir: Path, dest: Path, tokens: list) -> Path:
    """A copy of the model whose generation_config.json names `tokens` as end tokens too
    (Phi-3's lists <|end|>, Llama-3-Instruct's <|eot_id|>)."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, dest)
    tok = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    gen = json.loads((dest / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, *tok.convert_tokens_to_ids(tokens)]
    (dest / "generation_config.json").write_text(json.dumps(gen))
    return dest


def test_a_turn_ends_where_the_models_generate_stops(tmp_path, model_dir):
    """Phi-3's template writes EOS after the last turn only, and its model stops at <|end|>
    (its generation_config.json's end tokens). The EOS after <|end|> was learned (a token
    the model never writes), and every conversation of more than one turn was staged turn by
    turn (its tokens growing with the square of its turns). Now each turn is learned to
    <|end|>, as transformers marks it, and a conversation is one document."""
    model = with_end_tokens(model_dir, tmp_path / "phi3", ["<|end|>"])
    plain = with_template(model, tmp_path / "plain", unmarked(PHI3_TEMPLATE))
    marked = with_template(model, tmp_path / "marked", PHI3_TEMPLATE)
    train = write_chats(tmp_path / "train.jsonl", CHATS)
    manifest, out = stage(tmp_path, chat_config(tmp_path, model, train, packing=False,
                                                max_length=512, tokenizer=str(plain)))
    x, y = np.load(out / "train_x.npy"), np.load(out / "train_y.npy")
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(plain), local_files_only=True).eos_token_id
    assert x.shape[0] == len(CHATS) and manifest["text"]["per_turn_conversations"] == 0
    for row, messages in enumerate(CHATS):
        ids, mask = oracle_chat(marked, messages)
        assert ids[-1] == eos and not mask[-1]
        assert x[row, :len(ids)].tolist() == ids, row
        assert y[row, :len(ids)].tolist() == [t if m else IGNORE for t, m in zip(ids, mask)]
