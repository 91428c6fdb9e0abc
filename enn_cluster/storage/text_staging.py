"""Tokenize a text corpus once, at staging, into token memmaps for a causal LM.

RUN/data/train_x.npy holds int32 token ids [rows, max_length]; train_y.npy the labels: the
same ids, with -100 wherever the loss ignores the token (pads, prompt tokens, a document's
first token, a chat's system and user turns and role headers). No shift: the model shifts.
A document's ids are its prompt's (with the tokenizer's default special tokens, e.g. BOS)
then its text's (without them; with them when there is no prompt), then EOS; a chat's are
its template's rendering, as `apply_chat_template` tokenizes it (`storage.chat_tokens`).
Packing on: documents run on across rows of exactly max_length; the tail shorter than a row
is dropped (counted); in training a text document attends only to itself (positions
restart after each EOS: lm_loss.packed_positions; chats, whose turns may end in EOS, are
not split so). Packing off: one document per row, truncated to max_length (counted), EOS
kept if it fits, right-padded with the pad id (the tokenizer's, else EOS).

Documents stream from the file in batches (`storage.text_sources`); each batch is encoded
by the fast tokenizer's Rust backend on every core of the host (encode_batch_fast), the
next batch encoded on a helper thread while this one is laid out. Token streams grow in two
temporary files in the data directory; the memmaps are then written from them through
`memmap_writer.write_memmap` (checksummed, fsynced, renamed), so the manifest's entries are
those of any staged array. The run directory is made all or nothing around this, and
`resume` never stages again.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, TextIO

import numpy as np

from enn_cluster.config.hf_name import end_token_ids, weights_dir
from enn_cluster.config.run_config import DataConfig, ModelConfig
from enn_cluster.errors import UserError
from enn_cluster.storage.chat_tokens import ChatEncoder
from enn_cluster.storage.memmap_writer import held_out_rows, write_manifest, write_memmap
from enn_cluster.storage.text_sources import (
    iter_conversations,
    iter_documents,
    load_tokenizer,
    text_files,
    tokenizer_hash,
)

IGNORE = -100  # the label the loss skips (torch's cross_entropy ignore_index)
BATCH_DOCS = 2048  # documents per encode_batch call
PADDED_BATCH_BYTES = 64 << 20  # packing off: the padded rows of one batch, ids and labels
_COPY_ELEMS = 4 << 20  # int32s per block copied from a token stream into its memmap
TOKEN_DTYPE = np.dtype(np.int32)


@dataclass
class TextCounts:
    documents: int = 0
    tokens: int = 0  # real (non-pad) tokens staged
    rows: int = 0
    truncated_documents: int = 0  # packing off: documents longer than a row
    learned_tokens: int = 0  # labels the loss learns (not IGNORE) in the staged tokens
    dropped_tokens: int = 0  # packing on: the tail shorter than a row
    per_turn_conversations: int = 0  # chats staged one document per assistant turn


@dataclass(frozen=True)
class Layout:
    """How documents become rows (pure: no tokenizer, no files)."""

    max_length: int
    packing: bool
    eos_id: int
    pad_id: int


def document_tokens(layout: Layout, prompt_ids: Optional[list], text_ids: list):
    """One batch of documents as a flat token stream and its labels: each document is its
    prompt's ids, its text's ids and EOS; labels are the ids, IGNORE on prompt tokens and
    on each document's first token (packed, it would be learned from the previous one's
    EOS, which it cannot see).
    Returns (ids, labels, per-document lengths), int32/int64 numpy arrays. The id lists
    given are consumed (extended in place)."""
    n = len(text_ids)
    text_lens = np.fromiter(map(len, text_ids), np.int64, n) + 1  # + EOS
    prompt_lens = (np.fromiter(map(len, prompt_ids), np.int64, n) if prompt_ids is not None
                   else np.zeros(n, np.int64))
    total = int(text_lens.sum() + prompt_lens.sum())
    docs = text_ids if prompt_ids is None else prompt_ids
    if prompt_ids is not None:
        for head, text in zip(prompt_ids, text_ids):  # in place: the lists are ours
            head.extend(text)
    for doc in docs:
        doc.append(layout.eos_id)
    ids = np.fromiter(itertools.chain.from_iterable(docs), TOKEN_DTYPE, total)
    labels = ids.copy()
    if prompt_ids is not None and prompt_lens.any():
        segments = np.empty(2 * n, np.int64)
        segments[0::2], segments[1::2] = prompt_lens, text_lens
        learned = np.repeat(np.tile(np.array([False, True]), n), segments)
        labels[~learned] = IGNORE
    lengths = prompt_lens + text_lens
    labels[np.cumsum(lengths) - lengths] = IGNORE  # nothing before it in its document
    return ids, labels, lengths


def chat_documents(docs: list, masks: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One batch of chats (ids and learned masks, as `chat_tokens.ChatEncoder` gives them)
    as a flat token stream, its labels (IGNORE where not learned) and per-chat lengths; no
    EOS is added: the template writes each turn's end."""
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    ids = np.fromiter(itertools.chain.from_iterable(docs), TOKEN_DTYPE, int(lengths.sum()))
    labels = ids.copy()
    if masks:
        labels[~np.concatenate(masks)] = IGNORE
    return ids, labels, lengths


def padded_rows(layout: Layout, ids: np.ndarray, labels: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packing off: one row per document, truncated to max_length (EOS too when it does not
    fit), right-padded with the pad id; labels IGNORE on pads."""
    n, width = len(lengths), layout.max_length
    x = np.full((n, width), layout.pad_id, TOKEN_DTYPE)
    y = np.full((n, width), IGNORE, TOKEN_DTYPE)
    starts = np.cumsum(lengths) - lengths
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(len(ids)) - np.repeat(starts, lengths)
    keep = col < width
    x[row[keep], col[keep]] = ids[keep]
    y[row[keep], col[keep]] = labels[keep]
    return x, y


class _Encoder:
    """Batched encoding with the fast tokenizer's Rust backend: all cores, GIL released."""

    def __init__(self, tok) -> None:
        backend = tok.backend_tokenizer
        backend.no_truncation()  # what transformers' call does unless asked to truncate/pad
        backend.no_padding()
        self.backend = backend
        # the special tokens the tokenizer appends (Llama-2-style `add_eos_token`: `</s>`):
        # cut, since staging ends each document itself, and an EOS between a prompt and
        # its text would split them into two packed documents that cannot see each other
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(plain) + 1)
                      if full[i:i + len(plain)] == plain), len(full))
        self.appended = max(len(full) - start - len(plain), 0)

    def __call__(self, texts: list[str], prompts: Optional[list[str]]):
        if prompts is None:  # the tokenizer's default special tokens (BOS) on the text
            return None, self._ids(texts, True)
        return self._ids(prompts, True), self._ids(texts, False)

    def _ids(self, texts: list[str], special: bool) -> list:
        encoded = self.backend.encode_batch_fast(texts, add_special_tokens=special)
        if special and self.appended:
            return [e.ids[:-self.appended] for e in encoded]
        return [e.ids for e in encoded]

    def plain(self, texts: list[str]) -> list:
        """Rendered chats: the template wrote every special token they hold."""
        return self._ids(texts, False)


def _batches(key: str, path: str, data: DataConfig, layout: Layout, encoder: _Encoder,
             chats: Optional[ChatEncoder], batch: int):
    """(raw batches of the file, the function that lays one out as (ids, labels, lengths,
    conversations staged one document per assistant turn))."""
    if chats is not None:
        def chat_batch(rows):
            docs, masks, per_turn = chats(*rows)
            return (*chat_documents(docs, masks), per_turn)

        return iter_conversations(key, path, data, batch), chat_batch
    return (iter_documents(key, path, data, batch),
            lambda docs: (*document_tokens(layout, *encoder(*docs)), 0))


def _tokenize_file(key: str, path: str, data: DataConfig, layout: Layout, encoder: _Encoder,
                   chats: Optional[ChatEncoder], streams: tuple[Path, Path]) -> TextCounts:
    """Pass one: every document encoded and appended, laid out, to the two token streams
    (ids, labels); the next batch is read and encoded while this one is laid out."""
    counts = TextCounts()
    batch = BATCH_DOCS if layout.packing else \
        max(1, min(BATCH_DOCS, PADDED_BATCH_BYTES // (2 * TOKEN_DTYPE.itemsize * layout.max_length)))
    batches, lay_out = _batches(key, path, data, layout, encoder, chats, batch)
    with open(streams[0], "wb") as fx, open(streams[1], "wb") as fy, \
            ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
        nxt = pool.submit(_encode_next, batches, lay_out)
        while True:
            encoded = nxt.result()
            if encoded is None:
                break
            nxt = pool.submit(_encode_next, batches, lay_out)
            ids, labels, lengths, per_turn = encoded
            counts.documents += len(lengths)
            counts.per_turn_conversations += per_turn
            if not layout.packing:
                ended = 0 if chats is not None else 1  # the EOS staging adds may be cut
                counts.truncated_documents += int((lengths - ended > layout.max_length).sum())
                counts.tokens += int(np.minimum(lengths, layout.max_length).sum())
                ids, labels = padded_rows(layout, ids, labels, lengths)
            else:
                counts.tokens += len(ids)
            counts.learned_tokens += int((labels != IGNORE).sum())
            fx.write(memoryview(ids).cast("B"))
            fy.write(memoryview(labels).cast("B"))
    if layout.packing:
        counts.rows = counts.tokens // layout.max_length
        counts.dropped_tokens = counts.tokens - counts.rows * layout.max_length
        counts.tokens -= counts.dropped_tokens
    else:
        counts.rows = counts.documents
    return counts


def _encode_next(batches, lay_out):
    batch = next(batches, None)
    return None if batch is None else lay_out(batch)


def _stream_to_memmap(stream: Path, dest: Path, rows: int, width: int, source: str,
                      progress: Optional[TextIO]) -> dict:
    """The first rows x width int32s of a token stream, as a staged memmap (then the stream
    is removed)."""
    def fill(out: np.memmap, running) -> None:
        flat = out.reshape(-1)
        with open(stream, "rb", buffering=0) as fh:
            for start in range(0, flat.size, _COPY_ELEMS):
                block = flat[start:start + _COPY_ELEMS]
                view = memoryview(block).cast("B")
                got = 0
                while got < len(view):
                    n = fh.readinto(view[got:])
                    if not n:
                        raise OSError(f"{stream}: token stream ended early")
                    got += n
                running.update(block)

    try:
        entry = write_memmap(dest, (rows, width), TOKEN_DTYPE, fill, progress)
    finally:
        stream.unlink(missing_ok=True)
    entry["source"] = source
    return entry


def _stage_split(key: str, path: str, split: str, data: DataConfig, layout: Layout,
                 encoders: tuple, data_dir: Path, progress: Optional[TextIO]) -> tuple:
    """One file (train or eval) tokenized into {split}_x.npy and {split}_y.npy."""
    streams = (data_dir / f".{split}_x.tokens-{os.getpid()}",
               data_dir / f".{split}_y.tokens-{os.getpid()}")
    try:
        counts = _tokenize_file(key, path, data, layout, *encoders, streams)
        if counts.rows == 0:
            raise UserError(f"data.max_length: {path} holds {counts.dropped_tokens} tokens, "
                            f"fewer than one row of {layout.max_length}; lower data.max_length "
                            "or add text")
        if counts.learned_tokens == 0 and counts.truncated_documents:
            # a run would train on a loss of 0 (eval: NaN), silently
            raise UserError(f"data.max_length: no token of {path} is learned: "
                            f"{counts.truncated_documents} of its {counts.documents} documents "
                            f"are cut at {layout.max_length} tokens before the part the loss "
                            "learns; raise data.max_length or shorten the prompts")
        entries = {f"{split}_{axis}": _stream_to_memmap(stream, data_dir / f"{split}_{axis}.npy",
                                                        counts.rows, layout.max_length, path,
                                                        progress)
                   for axis, stream in zip("xy", streams)}
    finally:
        for stream in streams:
            stream.unlink(missing_ok=True)
    return entries, counts


def stage_text_data(data: DataConfig, model: ModelConfig, data_dir: Path,
                    progress: Optional[TextIO] = None) -> dict:
    """Tokenize data.train_path (and data.eval_path) into token memmaps with a manifest."""
    tok_dir, tok = load_tokenizer(data, model)
    eos = int(tok.eos_token_id)
    layout = Layout(data.max_length, data.packing, eos,
                    eos if tok.pad_token_id is None else int(tok.pad_token_id))
    encoder = _Encoder(tok)
    encoders = (encoder, ChatEncoder(tok, tok_dir, encoder.plain,
                                     [*end_token_ids(weights_dir(model.name)), eos])
                if data.messages_field else None)
    entries: dict = {}
    counts: dict = {}
    for key, path in text_files(data):
        split = "train" if key == "data.train_path" else "eval"
        split_entries, counts[split] = _stage_split(key, path, split, data, layout, encoders,
                                                    data_dir, progress)
        entries.update(split_entries)
    manifest = {"entries": entries,
                **held_out_rows(counts["train"].rows, data.eval_fraction, "eval" in counts)}
    train = counts["train"]
    manifest["text"] = {
        "tokenizer": str(tok_dir), "tokenizer_hash": tokenizer_hash(tok_dir),
        "documents": train.documents, "tokens": train.tokens, "rows": train.rows,
        "packing": data.packing, "max_length": data.max_length, "pad_token_id": layout.pad_id,
        "eos_token_id": eos, "bos_token_id": tok.bos_token_id, "text_field": data.text_field,
        "prompt_field": data.prompt_field, "messages_field": data.messages_field,
        "truncated_documents": train.truncated_documents,
        "dropped_tokens": train.dropped_tokens,
        "per_turn_conversations": train.per_turn_conversations,
    }
    if "eval" in counts:
        manifest["text"]["eval"] = asdict(counts["eval"])
    write_manifest(data_dir, manifest)
    return manifest


def text_rows(key: str, path: str, data: DataConfig, model: ModelConfig) -> np.ndarray:
    """Prediction input from text: one row per document (its prompt, then its text, as staged
    for training but with no EOS appended; a chat rendered by its template, with the
    generation prompt when it does not end with an assistant turn), truncated to
    data.max_length and right-padded with -1 (int32), in file order."""
    tok_dir, tok = load_tokenizer(data, model)
    encoder = _Encoder(tok)
    if data.messages_field:
        chats = ChatEncoder(tok, tok_dir, encoder.plain)
        rows = [ids[:data.max_length]
                for batch in iter_conversations(key, path, data, BATCH_DOCS, need_assistant=False)
                for ids in chats.prompts(*batch)]
    else:
        rows = [((prompt_ids[i] if prompt_ids else []) + ids)[:data.max_length]
                for batch in iter_documents(key, path, data, BATCH_DOCS)
                for prompt_ids, text_ids in [encoder(*batch)]
                for i, ids in enumerate(text_ids)]
    out = np.full((len(rows), data.max_length), -1, dtype=TOKEN_DTYPE)
    for i, ids in enumerate(rows):
        out[i, :len(ids)] = ids
    return out
