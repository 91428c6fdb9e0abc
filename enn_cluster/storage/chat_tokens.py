"""Chat data for a causal LM: each row's messages checked, rendered by the tokenizer's own
chat template, and masked so that only the assistant turns are learned.

Real templates (Qwen2.5, Llama-3) carry no `{% generation %}` markers, so the assistant spans
are found without them: a conversation is rendered whole, and, for each assistant turn, once
up to it with the generation prompt (where a model starts to write) and once through it. A
turn's learned tokens run from the end of the first rendering to the first of the model's
end tokens in the second (where its `generate` stops: `<|im_end|>`, `<|eot_id|>`, Phi-3's
`<|end|>`), else to its last special token; what the template writes after that (ChatML's
newline, Phi-3's EOS) is layout a model never generates, and is not learned. A turn with no
special token is learned to its end.

When each turn's span is in the whole rendering as in the turn's own, the conversation is
one document with every assistant turn learned. A template that renders earlier turns
otherwise once a later one exists (Qwen3 drops their reasoning once a user turn follows)
has no such spans: its conversation is staged as one document per assistant turn, the
conversation through that turn with only it learned, which is what a model answers each
turn from at inference (the earlier turns are context, as the template renders them then).
A template whose rendering up to a turn is not the start of its rendering through it is
refused, since no span of it could be trusted.

Rendering is transformers' own (`apply_chat_template`, its sandboxed jinja); the tokens are
the fast tokenizer's batched encoding of the rendered text without added special tokens, as
`apply_chat_template(tokenize=True)` makes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from enn_cluster.errors import UserError

ROLES = ("system", "user", "assistant")
KEY = "data.messages_field"


def conversation_error(value, need_assistant: bool = True) -> Optional[str]:
    """What is wrong with one row's messages (a phrase that follows the field's name), or
    None when it is a list of {"role", "content"} messages of known roles with text."""
    if value is None:
        return "is missing (null); drop or fill the row"
    if not isinstance(value, list):
        return (f"holds {type(value).__name__}, not a list of messages; give "
                '[{"role": "user", "content": "..."}, ...]')
    if not value:
        return "is an empty list; give at least a user and an assistant message"
    for number, message in enumerate(value, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f'message {number} is not an object with "role" and "content"; fix the row'
        if message["role"] not in ROLES:
            return (f"message {number} has role {message['role']!r}; the roles are "
                    f"{', '.join(ROLES)}: fix the row")
        if not isinstance(message["content"], str):
            return (f"message {number}'s content holds {type(message['content']).__name__}, "
                    "not text; fix the row")
    if value[0]["role"] == "assistant":  # nothing before it to render its start from
        return ("starts with an assistant message; start it with a system or user message: "
                "fix the row")
    if need_assistant and not any(m["role"] == "assistant" for m in value):
        return "has no assistant message (nothing to learn); add one or drop the row"
    return None


def check_conversation(value, field: str, where: str, need_assistant: bool = True) -> list:
    """The row's messages, each with every key it holds (a template may read more than
    role and content: Qwen3's `reasoning_content`, a tool call's `name`, as transformers
    hands them over), or one line naming the row (`where`: "FILE line N" or "FILE row N")
    and the field."""
    error = conversation_error(value, need_assistant)
    if error:
        raise UserError(f"{KEY}: {where}: {field!r} {error}")
    return [dict(m) for m in value]


def turn_span(before: list, through: list, joined: bool, specials: frozenset,
              ends: frozenset) -> Optional[tuple[int, int]]:
    """(start, end) of an assistant turn's learned tokens in `through` (the conversation's
    ids rendered through the turn), given `before` (rendered up to it with the generation
    prompt) and `joined` (before's text is the start of through's); None when `before` is
    not the start of `through`.
    From the end of `before`, or from its last token when the turn's first characters
    merge with it into one token (Qwen2's and Llama-3's newline after the role header and a
    reply that starts with one: a single "\n\n"), which transformers' assistant mask
    marks too. To the first of the model's end tokens (`ends`: where its `generate` stops,
    so Phi-3's <|end|> and not the EOS its template writes after), else to the last special
    token, else to the end."""
    start = len(before)
    if start > len(through) or not joined:
        return None
    if through[:start] != before:
        if start == 0 or through[:start - 1] != before[:-1]:
            return None
        start -= 1
    end = next((i + 1 for i in range(start, len(through)) if through[i] in ends), None)
    if end is None:
        end = len(through)
        while end > start and through[end - 1] not in specials:
            end -= 1
        end = end if end > start else len(through)
    return start, end


def assistant_mask(full: list, turns: list, specials: frozenset,
                   ends: frozenset = frozenset()) -> Optional[np.ndarray]:
    """Which tokens of `full` (a conversation's ids) are learned, given each assistant turn
    as (ids rendered up to it with the generation prompt, ids rendered through it, whether
    the first text starts the second); None when a turn's span is not found (turn_span) or
    `full` does not hold it as rendered through the turn."""
    mask = np.zeros(len(full), bool)
    for before, through, joined in turns:
        span = turn_span(before, through, joined, specials, ends)
        if span is None or full[:span[1]] != through[:span[1]]:
            return None
        mask[span[0]:span[1]] = True
    return mask


def require_chat_template(tok, tokenizer_dir: Path) -> None:
    if not tok.chat_template:
        raise UserError(f"{KEY}: the tokenizer in {tokenizer_dir} has no chat_template "
                        "(tokenizer_config.json or chat_template.jinja); set data.tokenizer "
                        "to a chat model's tokenizer, or give text with data.text_field")


def special_ids(tok) -> frozenset:
    """Every special token of the tokenizer: its named ones and every added special token
    (Llama-3 lists <|eot_id|> only among the added ones)."""
    added = {i for i, t in tok.added_tokens_decoder.items() if getattr(t, "special", False)}
    return frozenset(added | set(tok.all_special_ids))


class ChatEncoder:
    """Conversations to (ids, learned mask) per row, in batches; `encode` is the fast
    tokenizer's batched encoding without added special tokens."""

    def __init__(self, tok, tokenizer_dir: Path, encode: Callable[[list], list],
                 ends: Iterable[int] = ()) -> None:
        require_chat_template(tok, tokenizer_dir)
        self.tok, self.dir, self.encode = tok, tokenizer_dir, encode
        self.specials = special_ids(tok)
        self.ends = frozenset(ends)  # the model's end tokens (hf_name.end_token_ids)

    def render(self, messages: list, generation_prompt: bool, where: str) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template's raise_exception, jinja errors: one line
            raise UserError(f"{KEY}: {where}: the chat template in {self.dir} refuses the "
                            f"conversation ({type(exc).__name__}: {str(exc)[:200]}); fix the "
                            "row") from None

    def __call__(self, conversations: list, wheres: list) -> tuple[list, list, int]:
        """(ids, learned mask) of each staged document, and how many conversations were
        staged one document per assistant turn (`per_turn`); one batched encode of every
        rendering."""
        texts, plan = [], []
        for messages, where in zip(conversations, wheres):
            first = len(texts)
            texts.append(self.render(messages, False, where))
            for i, message in enumerate(messages):
                if message["role"] == "assistant":
                    texts.append(self.render(messages[:i], True, where))
                    texts.append(self.render(messages[:i + 1], False, where))
            plan.append((first, len(texts), where))
        encoded = self.encode(texts)
        docs, masks, split = [], [], 0
        for first, end, where in plan:
            full = encoded[first]
            turns = [(encoded[i], encoded[i + 1], texts[i + 1].startswith(texts[i]))
                     for i in range(first + 1, end, 2)]
            mask = assistant_mask(full, turns, self.specials, self.ends)
            if mask is not None:
                docs.append(full)
                masks.append(mask)
                continue
            split += 1
            for number, turn in enumerate(turns, 1):
                through = turn[1]
                mask = assistant_mask(through, [turn], self.specials, self.ends)
                if mask is None:
                    raise UserError(
                        f"{KEY}: {where}: the chat template in {self.dir} renders the "
                        f"conversation up to assistant turn {number} with the generation "
                        "prompt as other than the start of the conversation through that "
                        "turn, so the turn's tokens cannot be told apart (a generation prompt "
                        "unlike the turn's start, a system message placed only before a "
                        "last user turn); use a template that renders a conversation's start "
                        "alike whatever follows, or give text with data.prompt_field")
                docs.append(through)
                masks.append(mask)
        return docs, masks, split

    def prompts(self, conversations: list, wheres: list) -> list:
        """Prediction input: each conversation rendered as it stands, with the generation
        prompt when it does not end with an assistant turn (what a model answers next)."""
        texts = [self.render(m, m[-1]["role"] != "assistant", w)
                 for m, w in zip(conversations, wheres)]
        return self.encode(texts)
