"""Text staging for causal LMs: token memmaps equal the Hugging Face tokenizer's own encoding,
labels masked where the loss must ignore them, bad input refused in one line before any run
directory exists, and a resume that never tokenizes again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from enn_cluster.client import llm_assets  # noqa: E402
from enn_cluster.storage import text_staging  # noqa: E402
from enn_cluster.storage.text_sources import tokenizer_hash  # noqa: E402
from enn_cluster.storage.text_staging import IGNORE, Layout, document_tokens, padded_rows  # noqa: E402
from lm_support import PRECISIONS, tiny_model  # noqa: E402
from lm_support import assert_refused_before_any_run  # noqa: E402
from lm_support import prepare_text as prepare, stage_text as stage  # noqa: E402

TEXTS = llm_assets.corpus(120, seed=5)
PROMPTS = [f"question {i}: what runs next" if i % 3 else "" for i in range(len(TEXTS))]


@pytest.fixture(scope="module", params=PRECISIONS)
def model_dir(request, tmp_path_factory) -> Path:
    """fp32, and the users' world: weights in bf16, every token id above 4000."""
    return tiny_model(tmp_path_factory.mktemp("llm"), precision=request.param)


@pytest.fixture(scope="module")
def users_model_dir(tmp_path_factory) -> Path:
    """The users' world alone (bf16 weights, ids above 4000), for refusals and lookups that
    happen before any weight is read: an fp32 twin would run the same lines again."""
    return tiny_model(tmp_path_factory.mktemp("llm-users"), precision="bf16")


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory, model_dir) -> Path:
    """The same vocabulary with a BOS post-processor (as Llama's) and no pad token: BOS comes
    from the tokenizer's default special tokens, pads from EOS."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("bos")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def expected_documents(tok, texts, prompts=None):
    """Each document as the HF tokenizer encodes it: prompt (default special tokens), text
    (none when there is a prompt field), EOS; and which of its tokens are learned (never the
    first: nothing before it in its document predicts it)."""
    docs = []
    for i, text in enumerate(texts):
        if prompts is None:
            ids, n_prompt = tok(text)["input_ids"], 0
        else:
            head = tok(prompts[i])["input_ids"]
            ids, n_prompt = head + tok(text, add_special_tokens=False)["input_ids"], len(head)
        ids = ids + [tok.eos_token_id]
        docs.append((ids, [False] * max(n_prompt, 1) + [True] * (len(ids) - max(n_prompt, 1))))
    return docs


def lm_config(tmp_path, model_dir, train, **data) -> dict:
    return {"run_name": "lm", "runs_root": str(tmp_path / "runs"),
            "model": {"name": f"hf:{model_dir}"},
            "data": {"train_path": str(train), "max_length": 32, **data},
            "training": {"per_device_train_batch_size": 2}}


def staged(out: Path, split: str = "train"):
    return np.load(out / f"{split}_x.npy"), np.load(out / f"{split}_y.npy")


# ---------------------------------------------------------------------------------------
# Layout, pure


def test_layout_by_hand():
    layout = Layout(max_length=4, packing=False, eos_id=2, pad_id=0)
    ids, labels, lengths = document_tokens(layout, [[5], []], [[7, 8], [9, 9, 9, 9]])
    assert ids.tolist() == [5, 7, 8, 2, 9, 9, 9, 9, 2]
    # a document's first token is not learned: nothing of its own comes before it
    assert labels.tolist() == [IGNORE, 7, 8, 2, IGNORE, 9, 9, 9, 2]
    assert lengths.tolist() == [4, 5]
    x, y = padded_rows(layout, ids, labels, lengths)
    assert x.tolist() == [[5, 7, 8, 2], [9, 9, 9, 9]]  # no room for EOS: truncated
    assert y.tolist() == [[IGNORE, 7, 8, 2], [IGNORE, 9, 9, 9]]
    x, y = padded_rows(Layout(6, False, 2, 0), ids, labels, lengths)
    assert x.tolist() == [[5, 7, 8, 2, 0, 0], [9, 9, 9, 9, 2, 0]]
    assert y.tolist() == [[IGNORE, 7, 8, 2, IGNORE, IGNORE], [IGNORE, 9, 9, 9, 2, IGNORE]]


# ---------------------------------------------------------------------------------------
# Staged tokens against the tokenizer's own encoding


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_packed_rows_are_the_tokenizers_encoding(tmp_path, model_dir, suffix, monkeypatch):
    monkeypatch.setattr(text_staging, "BATCH_DOCS", 7)  # many batches, each encoded ahead
    train = llm_assets.write_texts(tmp_path / f"train{suffix}", TEXTS)
    manifest, out = stage(tmp_path, lm_config(tmp_path, model_dir, train))
    docs = expected_documents(hf_tokenizer(model_dir), TEXTS)
    stream = [t for ids, _ in docs for t in ids]
    learned = [m for _, mask in docs for m in mask]
    rows = len(stream) // 32
    x, y = staged(out)
    assert x.dtype == y.dtype == np.int32 and x.shape == (rows, 32)
    assert x.reshape(-1).tolist() == stream[:rows * 32]
    # no prompt, no pads: every token is learned but each document's first
    assert y.reshape(-1).tolist() == [t if m else IGNORE for t, m in zip(stream, learned)][:rows * 32]
    assert (y == IGNORE).sum() == sum(not m for m in learned[:rows * 32]) > 1
    text = manifest["text"]
    assert text["documents"] == len(TEXTS) and text["rows"] == rows
    assert text["tokens"] == rows * 32 and text["dropped_tokens"] == len(stream) - rows * 32
    assert text["packing"] is True and text["max_length"] == 32
    assert text["truncated_documents"] == 0 and text["tokenizer"] == str(model_dir)
    assert manifest["train_rows"] == [0, rows] and manifest["eval_rows"] is None
    for name in ("train_x", "train_y"):
        entry = manifest["entries"][name]
        assert entry["shape"] == [rows, 32] and entry["dtype"] == "<i4"
        assert entry["checksum"].startswith("xxh3:") and entry["source"] == str(train)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_x.npy", "train_y.npy"]


def test_packed_prompt_tokens_are_not_learned(tmp_path, bos_tokenizer, model_dir):
    train = llm_assets.write_texts(tmp_path / "train.parquet", TEXTS, prompt=PROMPTS)
    cfg = lm_config(tmp_path, model_dir, train, prompt_field="prompt",
                    tokenizer=str(bos_tokenizer))
    manifest, out = stage(tmp_path, cfg)
    tok = hf_tokenizer(bos_tokenizer)
    docs = expected_documents(tok, TEXTS, PROMPTS)
    assert docs[0][0][0] == tok.bos_token_id  # the tokenizer's default: BOS before the prompt
    stream = [t for ids, _ in docs for t in ids]
    learned = [m for _, mask in docs for m in mask]
    rows = len(stream) // 32
    x, y = staged(out)
    assert x.reshape(-1).tolist() == stream[:rows * 32]
    want = [t if m else IGNORE for t, m in zip(stream, learned)][:rows * 32]
    assert y.reshape(-1).tolist() == want
    assert (y == IGNORE).any() and manifest["text"]["prompt_field"] == "prompt"


def test_padded_rows_one_document_each(tmp_path, bos_tokenizer, model_dir, monkeypatch):
    monkeypatch.setattr(text_staging, "PADDED_BATCH_BYTES", 2 * 4 * 32 * 5)  # 5 rows a batch
    train = llm_assets.write_texts(tmp_path / "train.jsonl", TEXTS, prompt=PROMPTS)
    cfg = lm_config(tmp_path, model_dir, train, prompt_field="prompt", packing=False,
                    tokenizer=str(bos_tokenizer), eval_fraction=0.25)
    manifest, out = stage(tmp_path, cfg)
    tok = hf_tokenizer(bos_tokenizer)
    assert tok.pad_token_id is None  # pads are EOS, told apart by their position only
    x, y = staged(out)
    assert x.shape == (len(TEXTS), 32)
    truncated = tokens = 0
    for row, (ids, mask) in enumerate(expected_documents(tok, TEXTS, PROMPTS)):
        truncated += len(ids) - 1 > 32
        kept = ids[:32]
        tokens += len(kept)
        labels = [t if m else IGNORE for t, m in zip(ids, mask)][:32]
        pad = 32 - len(kept)
        assert x[row].tolist() == kept + [tok.eos_token_id] * pad, row
        assert y[row].tolist() == labels + [IGNORE] * pad, row
    text = manifest["text"]
    assert truncated > 0 and text["truncated_documents"] == truncated
    assert text["tokens"] == tokens and text["rows"] == len(TEXTS) == text["documents"]
    assert text["pad_token_id"] == text["eos_token_id"] == tok.eos_token_id
    assert text["bos_token_id"] == tok.bos_token_id
    assert manifest["train_rows"] == [0, 90] and manifest["eval_rows"] == [90, 120]


def test_eval_file_staged_beside_train(tmp_path, model_dir):
    train = llm_assets.write_texts(tmp_path / "train.parquet", TEXTS)
    evals = llm_assets.write_texts(tmp_path / "eval.jsonl", TEXTS[:40])
    manifest, out = stage(tmp_path, lm_config(tmp_path, model_dir, train, eval_path=str(evals),
                                              packing=False, eval_fraction=0.5))
    x, y = staged(out, "eval")
    tok = hf_tokenizer(model_dir)
    assert x.shape == (40, 32) and manifest["text"]["eval"]["documents"] == 40
    first = expected_documents(tok, TEXTS[:1])[0][0][:32]
    assert x[0, :len(first)].tolist() == first
    assert y[0, :len(first)].tolist() == [IGNORE] + first[1:]
    assert manifest["train_rows"] == [0, len(TEXTS)] and manifest["eval_rows"] is None
    assert manifest["entries"]["eval_x"]["source"] == str(evals)


def test_tokenizer_hash_is_the_files_identity(tmp_path, model_dir):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, copy / name)
    assert tokenizer_hash(copy) == tokenizer_hash(model_dir)  # the bytes, not the place
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["model_max_length"] = 64
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_hash(copy) != tokenizer_hash(model_dir)


# ---------------------------------------------------------------------------------------
# The real CLI: a run made once, bad input refused before it exists, resume never re-stages


def test_prepare_stages_once_and_resume_never_tokenizes_again(tmp_path, model_dir):
    from enn_cluster.client.launch_plan import plan_shape
    from enn_cluster.config.launch_shape import LaunchShape
    from enn_cluster.client.prepare import prepare_resume, resumed_config
    from enn_cluster.storage.rundir import RunDir

    weights = tmp_path / "weights"
    shutil.copytree(model_dir, weights)
    train = llm_assets.write_texts(tmp_path / "train.parquet", TEXTS)
    res = prepare(tmp_path, lm_config(tmp_path, weights, train, eval_fraction=0.1))
    assert res.returncode == 0, res.stderr
    run = RunDir(Path(res.stdout.strip()))
    manifest = json.loads((run.data_dir / "manifest.json").read_text())
    assert manifest["text"]["tokenizer_hash"] == tokenizer_hash(weights)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
              for p in run.data_dir.iterdir()}
    # nothing to tokenize from any more: a resume that staged again would fail here
    train.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).unlink()
    loaded = run.load_config()
    cfg = prepare_resume(run, loaded, plan_shape(resumed_config(loaded, ["training.epochs=2"]),
                                                 LaunchShape(1, 2)))
    assert cfg.parallel.procs_per_node == 2 and cfg.training.epochs == 2
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
             for p in run.data_dir.iterdir()}
    assert after == before


def _file(path: Path, text) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _parquet(path: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path))
    return path


def _sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk (a hole): one endless line."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


BAD = {  # name: (write the input under tmp, extra data keys, what the one line says)
    "missing text column": (lambda t: llm_assets.write_texts(t / "c.parquet", TEXTS, field="body"),
                            {}, ["c.parquet has no column 'text'", "its columns: body",
                                 "data.text_field"]),
    "missing text key": (lambda t: llm_assets.write_texts(t / "c.jsonl", TEXTS, field="body"),
                         {}, ["c.jsonl line 1 has no key 'text'", "its keys: body"]),
    "empty jsonl": (lambda t: _file(t / "c.jsonl", ""),
                    {}, ["c.jsonl is empty"]),
    "blank jsonl": (lambda t: _file(t / "c.jsonl", "\n \n"),
                    {}, ["c.jsonl is empty"]),
    "empty parquet": (lambda t: _parquet(t / "c.parquet", body=[]),
                      {}, ["c.parquet is empty (0 rows)"]),
    "non-text column": (lambda t: _parquet(t / "c.parquet", text=list(range(5))),
                        {}, ["column 'text' of", "holds int64, not text"]),
    "non-text prompt": (lambda t: _parquet(t / "c.parquet", text=TEXTS[:5], p=list(range(5))),
                        {"prompt_field": "p"}, ["data.prompt_field: column 'p'", "not text"]),
    "not parquet or jsonl": (lambda t: llm_assets.write_texts(t / "c.csv", TEXTS),
                             {}, ["c.csv' must be a .parquet or .jsonl file"]),
    "jsonl line not an object": (lambda t: _file(t / "c.jsonl", '["a", "b"]\n'), {}, ["c.jsonl line 1 is a JSON list, not an object"]),
    "later jsonl line not an object": (
        lambda t: _file(t / "c.jsonl", '{"text": "a b"}\n{"text": "c"}\n7\n'),
        {}, ["c.jsonl line 3 is a JSON int, not an object"]),
    "null text row": (lambda t: _parquet(t / "c.parquet", text=TEXTS[:3] + [None]),
                      {}, ["row 3 of", "has no text (null)"]),
    "not parquet inside": (lambda t: _file(t / "c.parquet", "hello"),
                           {}, ["c.parquet is not a readable parquet file"]),
    "too short for a row": (lambda t: llm_assets.write_texts(t / "c.jsonl", ["the"]),
                            {}, ["data.max_length:", "fewer than one row of 32"]),
    "not UTF-8": (lambda t: _file(t / "c.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
                  {}, ["c.jsonl is not UTF-8 text"]),
    "a line without end": (lambda t: _sparse(t / "c.jsonl", 10 << 30),  # 10 GB, no newline
                           {}, ["c.jsonl line 1 is longer than 67108864 characters"]),
    "a line nested 100,000 deep": (lambda t: _file(t / "c.jsonl", "[" * 100_000 + "\n"),
                                   {}, ["c.jsonl line 1 nests JSON deeper than a reader allows"]),
    "a later line nested deep": (
        lambda t: _file(t / "c.jsonl", "".join(f'{{"text": "{x}"}}\n' for x in TEXTS[:40])
                        + "[" * 100_000 + "\n"),
        {}, ["c.jsonl line 41 nests JSON deeper"]),
    "tokenizer without files": (lambda t: llm_assets.write_texts(t / "c.jsonl", TEXTS),
                                {"tokenizer": "EMPTY"}, ["data.tokenizer:", "has no tokenizer files"]),
    # another model's tokenizer, of a larger vocabulary: its ids have no embedding row
    "tokenizer past the vocabulary": (
        lambda t: llm_assets.write_texts(t / "c.jsonl", TEXTS),
        {"tokenizer": "LARGER"}, ["data.tokenizer: the tokenizer in", "gives token id",
                                  "past the model's vocabulary (vocab_size"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_text_input_is_one_line_exit_2_and_no_run(tmp_path, users_model_dir, case):
    write, extra, needles = BAD[case]
    source = write(tmp_path)
    if extra.get("tokenizer") == "EMPTY":
        (tmp_path / "empty").mkdir()
        extra = dict(extra, tokenizer=str(tmp_path / "empty"))
    if extra.get("tokenizer") == "LARGER":
        vocab = json.loads((users_model_dir / "config.json").read_text())["vocab_size"]
        llm_assets.write_tokenizer(tmp_path / "larger", TEXTS, reserved=vocab)
        extra = dict(extra, tokenizer=str(tmp_path / "larger"))
    res = prepare(tmp_path, lm_config(tmp_path, users_model_dir, source, **extra))
    assert_refused_before_any_run(res, tmp_path, needles)


def test_a_cached_model_name_is_found_offline_and_a_missing_one_refused(tmp_path, users_model_dir):
    """hf:ORG/NAME is looked up in the local Hugging Face cache (its real layout: refs/main
    names the snapshot), never on the network."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-lm"
    shutil.copytree(users_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    train = llm_assets.write_texts(tmp_path / "train.jsonl", TEXTS)
    cfg = lm_config(tmp_path, users_model_dir, train)
    cfg["model"]["name"] = "hf:acme/tiny-lm"
    res = prepare(tmp_path, cfg, env)
    assert res.returncode == 0, res.stderr
    manifest = json.loads((Path(res.stdout.strip()) / "data" / "manifest.json").read_text())
    assert manifest["text"]["tokenizer"] == str(repo / "snapshots" / commit)
    assert manifest["text"]["tokenizer_hash"] == tokenizer_hash(users_model_dir)
    cfg["model"]["name"], cfg["run_name"] = "hf:acme/absent", "lm2"
    res = prepare(tmp_path, cfg, env)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "'hf:acme/absent' names no directory with a config.json (and no model in the " \
        "local Hugging Face cache)" in res.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["lm"]


def test_a_jsonl_that_starts_with_a_byte_order_mark_stages_as_without(tmp_path, model_dir):
    """Issue 38: a UTF-8 byte-order mark before the first line is skipped, as pandas and
    datasets skip it (it was refused as "line 1 is not valid JSON")."""
    plain = llm_assets.write_texts(tmp_path / "plain.jsonl", TEXTS)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    rows = {}
    for name, source in (("plain", plain), ("marked", marked)):
        (tmp_path / name).mkdir()
        _, out = stage(tmp_path / name, lm_config(tmp_path, model_dir, source))
        rows[name] = staged(out)
    for a, b in zip(rows["plain"], rows["marked"]):
        np.testing.assert_array_equal(a, b)
