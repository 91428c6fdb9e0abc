"""Text corpora and tokenizers for causal-LM staging, judged before anything is written.

`prepare` checks the train (and eval) file and the tokenizer before the run directory exists:
a path that is neither `.parquet` nor `.jsonl`, an empty file, a missing or non-text column,
a jsonl line that is not an object, a tokenizer directory without tokenizer files: each one
line naming the file and the fix. Staging (`storage.text_staging`) then reads documents
through the same functions, in batches: pyarrow record batches for parquet, line by line
for jsonl, so a large corpus never sits in memory as Python strings.

pyarrow and transformers are imported only here, inside the functions (the CLI's fast path
imports neither).
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Iterator, Optional

from enn_cluster.config.hf_name import check_model_files, check_no_custom_code, weights_dir
from enn_cluster.config.lm_config import TEXT_SUFFIXES

from enn_cluster.config.run_config import DataConfig, ModelConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import RunningChecksum

# files that define a tokenizer's vocabulary: a directory with none of them has no tokenizer
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# every file a tokenizer's save_pretrained may write: its identity is the hash of these
TOKENIZER_FILES = VOCAB_FILES + ("tokenizer_config.json", "special_tokens_map.json",
                                 "added_tokens.json", "merges.txt", "chat_template.jinja",
                                 "sentencepiece.bpe.model")
LLM_EXTRA = "pip install 'enn_cluster[llm]'"


def text_files(data: DataConfig) -> list[tuple[str, str]]:
    """(config key, path) of the train file and, when set, the eval file."""
    files = [("data.train_path", data.train_path)]
    if data.eval_path:
        files.append(("data.eval_path", data.eval_path))
    return files


def check_text_sources(data: DataConfig, model: ModelConfig) -> None:
    """Everything staging needs, checked before the run directory exists: each text file
    (its type, its text and prompt fields, or its messages, on the first document) and the
    tokenizer (with a chat template for chat rows)."""
    for key, path in text_files(data):
        check_text_file(key, path, data)
    path, tok = load_tokenizer(data, model)
    if data.messages_field:
        from enn_cluster.storage.chat_tokens import require_chat_template

        require_chat_template(tok, path)


def check_text_file(key: str, path: str, data: DataConfig, need_assistant: bool = True) -> None:
    """One file's type and its first document; `need_assistant`: a chat row must hold an
    assistant turn (training) or may end before one (prediction)."""
    from enn_cluster.config.checks import check_regular_file

    if path == "synthetic" or not path.endswith(TEXT_SUFFIXES):
        raise UserError.on(key, f"{path!r} must be a .parquet or .jsonl file of text for a "
                                "causal_lm model; convert it or fix the path")
    if "://" in path or "::" in path:
        raise UserError.on(key, f"{path} is a URL; text for a causal_lm model is read from a "
                                "local (or shared) filesystem path: copy it there")
    check_regular_file(key, os.path.expanduser(path), "fix the path")
    if os.path.getsize(os.path.expanduser(path)) == 0:
        raise UserError.on(key, f"{path} is empty; give a file with at least one document")
    if path.endswith(".parquet"):
        (_messages_column if data.messages_field else _parquet_columns)(key, path, data)
    else:
        rows = (_jsonl_conversations(key, path, data, need_assistant, first_only=True)
                if data.messages_field else _jsonl_rows(key, path, data, first_only=True))
        for _ in rows:
            return
        raise UserError.on(key, f"{path} is empty (no JSON lines); give a file with at least "
                                "one document")


# ---------------------------------------------------------------------------------------
# Reading documents in batches


def iter_documents(key: str, path: str, data: DataConfig,
                   batch: int) -> Iterator[tuple[list[str], Optional[list[str]]]]:
    """(texts, prompts or None) in batches of up to `batch` documents, in file order."""
    if path.endswith(".parquet"):
        yield from _parquet_batches(key, path, data, batch)
        return
    texts: list[str] = []
    prompts: Optional[list[str]] = [] if data.prompt_field else None
    for text, prompt in _jsonl_rows(key, path, data):
        texts.append(text)
        if prompts is not None:
            prompts.append(prompt)
        if len(texts) == batch:
            yield texts, prompts
            texts, prompts = [], ([] if data.prompt_field else None)
    if texts:
        yield texts, prompts


def _parquet_file(key: str, path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError.on(key, f"reading {path} needs pyarrow; {LLM_EXTRA}") from None
    try:
        return pq.ParquetFile(os.path.expanduser(path))
    except Exception as exc:  # pyarrow's ArrowInvalid and friends: say which file, in one line
        raise UserError.on(key, f"{path} is not a readable parquet file ({str(exc)[:200]}); "
                                "write it with pyarrow or pandas.to_parquet") from None


def _parquet_columns(key: str, path: str, data: DataConfig) -> list[str]:
    """The columns to read, checked: present and of a string type; and the file has rows."""
    import pyarrow as pa

    pf = _parquet_file(key, path)
    if pf.metadata.num_rows == 0:
        raise UserError.on(key, f"{path} is empty (0 rows); give a file with at least one document")
    schema = pf.schema_arrow
    columns = [data.text_field] + ([data.prompt_field] if data.prompt_field else [])
    for field_key, name in zip(("data.text_field", "data.prompt_field"), columns):
        if name not in schema.names:
            held = ", ".join(schema.names[:20]) or "none"
            raise UserError(f"{field_key}: {path} has no column {name!r} (its columns: {held}); "
                            f"set {field_key} to the column holding text")
        kind = schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise UserError(f"{field_key}: column {name!r} of {path} holds {kind}, not text; "
                            f"set {field_key} to a string column")
    return columns


def _parquet_batches(key: str, path: str, data: DataConfig, batch: int):
    columns = _parquet_columns(key, path, data)
    done = 0
    for record_batch in _read_batches(key, path, columns, batch):
        text = record_batch.column(0)
        if text.null_count:
            first = done + int(text.is_null().to_numpy(zero_copy_only=False).argmax())
            raise UserError(f"data.text_field: row {first} of {path} has no text (null); "
                            "drop or fill the empty rows")
        prompts = None
        if data.prompt_field:  # a null prompt is no prompt
            prompts = record_batch.column(1).fill_null("").to_pylist()
        done += record_batch.num_rows
        yield text.to_pylist(), prompts


def _read_batches(key: str, path: str, columns: list[str], batch: int):
    """pyarrow record batches; a file damaged past its footer is one line, not a traceback."""
    import pyarrow as pa

    batches = _parquet_file(key, path).iter_batches(batch_size=batch, columns=columns)
    while True:
        try:
            record_batch = next(batches, None)
        except (OSError, pa.ArrowException) as exc:
            raise UserError.on(key, f"{path} cannot be read ({str(exc)[:200]}); write it "
                                    "again") from None
        if record_batch is None:
            return
        yield record_batch


# ---------------------------------------------------------------------------------------
# Chat rows: a column of messages (data.messages_field)


def iter_conversations(key: str, path: str, data: DataConfig, batch: int,
                       need_assistant: bool = True) -> Iterator[tuple[list, list]]:
    """(conversations, where each row is) in batches of up to `batch` rows, in file order,
    each row checked (`chat_tokens.check_conversation`)."""
    rows = (_parquet_conversations(key, path, data, batch, need_assistant)
            if path.endswith(".parquet") else _jsonl_conversations(key, path, data,
                                                                   need_assistant))
    while True:
        chunk = list(itertools.islice(rows, batch))
        if not chunk:
            return
        yield [c for c, _ in chunk], [w for _, w in chunk]


def _messages_column(key: str, path: str, data: DataConfig) -> list[str]:
    import pyarrow as pa

    pf = _parquet_file(key, path)
    if pf.metadata.num_rows == 0:
        raise UserError.on(key, f"{path} is empty (0 rows); give a file with at least one chat")
    schema, name = pf.schema_arrow, data.messages_field
    if name not in schema.names:
        held = ", ".join(schema.names[:20]) or "none"
        raise UserError(f"data.messages_field: {path} has no column {name!r} (its columns: "
                        f"{held}); set data.messages_field to the column holding the messages")
    kind = schema.field(name).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise UserError(f"data.messages_field: column {name!r} of {path} holds {kind}, not a "
                        "list of messages; set data.messages_field to a list column")
    return [name]


def _parquet_conversations(key: str, path: str, data: DataConfig, batch: int,
                           need_assistant: bool) -> Iterator[tuple[list, str]]:
    from enn_cluster.storage.chat_tokens import check_conversation

    done, field = 0, data.messages_field
    for record_batch in _read_batches(key, path, _messages_column(key, path, data), batch):
        for value in record_batch.column(0).to_pylist():
            where = f"{path} row {done}"
            yield check_conversation(value, field, where, need_assistant), where
            done += 1


def _jsonl_conversations(key: str, path: str, data: DataConfig, need_assistant: bool,
                         first_only: bool = False) -> Iterator[tuple[list, str]]:
    from enn_cluster.storage.chat_tokens import check_conversation

    field = data.messages_field
    for number, record in _jsonl_objects(key, path, data, first_only):
        if field not in record:
            held = ", ".join(list(record)[:20]) or "none"
            raise UserError(f"data.messages_field: {path} line {number} has no key {field!r} "
                            f"(its keys: {held}); set data.messages_field to the key holding "
                            "the messages")
        where = f"{path} line {number}"
        yield check_conversation(record[field], field, where, need_assistant), where


MAX_LINE_CHARS = 64 << 20  # a .jsonl line (one document) is read whole: at most this long


def _jsonl_rows(key: str, path: str, data: DataConfig,
                first_only: bool = False) -> Iterator[tuple[str, str]]:
    """(text, prompt) of each non-blank line, each line checked."""
    for number, record in _jsonl_objects(key, path, data, first_only):
        yield _text_of(path, number, record, data)


def _jsonl_objects(key: str, path: str, data: DataConfig,
                   first_only: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of each non-blank line. A line is read up to
    MAX_LINE_CHARS (a 10 GB file with no newline is refused, not read into memory); a
    leading UTF-8 byte-order mark is skipped (as pandas and datasets do)."""
    with open(os.path.expanduser(path), encoding="utf-8-sig") as fh:
        try:
            for number in itertools.count(1):
                line = fh.readline(MAX_LINE_CHARS + 1)
                if not line:
                    return
                if len(line) > MAX_LINE_CHARS:
                    raise UserError.on(key, f"{path} line {number} is longer than "
                                            f"{MAX_LINE_CHARS} characters (one document per line, "
                                            "each at most that long); split the document or fix "
                                            "the file") from None
                if not line.strip():
                    continue
                yield number, _jsonl_object(key, path, number, line, data)
                if first_only:
                    return
        except UnicodeDecodeError:
            raise UserError.on(key, f"{path} is not UTF-8 text; save it as UTF-8") from None


def _jsonl_object(key: str, path: str, number: int, line: str, data: DataConfig) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        raise UserError.on(key, f"{path} line {number} is not valid JSON; write one JSON "
                                "object per line") from None
    except RecursionError:
        raise UserError.on(key, f"{path} line {number} nests JSON deeper than a reader "
                                "allows; write one flat object per line") from None
    if ("\\ud" in line or "\\uD" in line) and not _encodes(record):
        raise UserError.on(key, f"{path} line {number} holds a lone UTF-16 surrogate escape "
                                "(half of a character, e.g. an emoji cut in two), which is not "
                                "text the tokenizer can take; fix or drop the row")
    if not isinstance(record, dict):
        raise UserError.on(key, f"{path} line {number} is a JSON {type(record).__name__}, not "
                                "an object; write one object per line, e.g. "
                                + (f'{{"{data.messages_field}": [...]}}' if data.messages_field
                                   else f'{{"{data.text_field}": "..."}}'))
    return record


def _encodes(record) -> bool:
    """Whether a parsed JSON value is all valid text: JSON may escape half of a UTF-16
    surrogate pair (`\\ud83d`), which Python keeps as a lone surrogate the tokenizer
    cannot take. Asked only of a line holding such an escape."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text_of(path: str, number: int, record: dict, data: DataConfig) -> tuple[str, str]:
    text = record.get(data.text_field)
    if data.text_field not in record:
        held = ", ".join(list(record)[:20]) or "none"
        raise UserError(f"data.text_field: {path} line {number} has no key {data.text_field!r} "
                        f"(its keys: {held}); set data.text_field to the key holding text")
    if not isinstance(text, str):
        raise UserError(f"data.text_field: {path} line {number}: {data.text_field!r} holds "
                        f"{type(text).__name__}, not text; set data.text_field to a text key")
    prompt = record.get(data.prompt_field, "") if data.prompt_field else ""
    if data.prompt_field and data.prompt_field not in record and number == 1:
        raise UserError(f"data.prompt_field: {path} line 1 has no key {data.prompt_field!r}; "
                        "set data.prompt_field to the key holding the prompt, or to ''")
    if not isinstance(prompt, str):
        if prompt is not None:
            raise UserError(f"data.prompt_field: {path} line {number}: {data.prompt_field!r} "
                            f"holds {type(prompt).__name__}, not text; give text or null")
        prompt = ""
    return text, prompt


# ---------------------------------------------------------------------------------------
# The tokenizer: where it is, loading it (fast only), and its identity


def tokenizer_dir(data: DataConfig, model: ModelConfig) -> tuple[str, Path]:
    """(config key that names it, directory): data.tokenizer, else the model's weights."""
    if data.tokenizer:
        return "data.tokenizer", Path(data.tokenizer).expanduser()
    return "model.name", weights_dir(model.name)


def load_tokenizer(data: DataConfig, model: ModelConfig):
    """(directory, a transformers fast tokenizer loaded from local files only)."""
    key, path = tokenizer_dir(data, model)
    if not path.is_dir():
        raise UserError(f"{key}: {path} is not a directory; give the directory a tokenizer's "
                        "save_pretrained wrote")
    check_model_files(path, key)  # a FIFO or /dev/zero in place of a tokenizer file
    check_no_custom_code(path, key)
    if not any((path / name).is_file() for name in VOCAB_FILES):
        raise UserError(f"{key}: {path} has no tokenizer files ({', '.join(VOCAB_FILES[:2])}); "
                        "set data.tokenizer to a directory a tokenizer's save_pretrained wrote")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"{key}: loading the tokenizer in {path} needs transformers; "
                        f"{LLM_EXTRA}") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True,
                                            trust_remote_code=False)
    except Exception as exc:  # a broken tokenizer file: name it in one line
        raise UserError(f"{key}: the tokenizer in {path} does not load ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); fix or re-save it with save_pretrained") from None
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise UserError(f"{key}: the tokenizer in {path} is not a fast tokenizer (no "
                        "tokenizer.json); save one with the tokenizers library or "
                        "transformers' PreTrainedTokenizerFast")
    if tok.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer in {path} has no eos_token; set eos_token in "
                        "its tokenizer_config.json (documents are ended with it)")
    return path, tok


def check_same_tokenizer(staged: Optional[dict], data: DataConfig, model: ModelConfig) -> None:
    """A run that tokenized text keeps its tokenizer's identity (the manifest's `text`
    entry, `staged`); a tokenizer changed since maps text to other ids than the model
    learned, so predicting text with it or exporting it beside the model is refused."""
    if not staged or not staged.get("tokenizer_hash"):
        return
    key, path = tokenizer_dir(data, model)
    now = tokenizer_hash(path) if path.is_dir() else "missing"
    if now != staged["tokenizer_hash"]:
        raise UserError(f"{key}: the tokenizer in {path} changed since this run tokenized its "
                        f"data (checksum {staged['tokenizer_hash']} then, {now} now): its ids "
                        "are not the ones the model learned; restore the tokenizer's files, "
                        "or start a new run with this tokenizer")


def tokenizer_hash(path: Path) -> str:
    """The tokenizer's identity: one checksum over its files (name, then bytes), names sorted."""
    running = RunningChecksum()
    for name in sorted(n for n in TOKENIZER_FILES if (path / n).is_file()):
        running.update(name.encode() + b"\0")
        running.update((path / name).read_bytes())
    return running.hexdigest()
