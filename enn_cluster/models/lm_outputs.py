"""What a causal LM's prediction computes of each row, as transformers' forward and
`generate` compute it.

Prediction rows are token ids right-padded with -1 (staged so by the client from text, or
given as an array). A row's score is the mean log-likelihood of its tokens after the first
and their count (`[mean_logprob, n]`); with `generate` the row's prompt is continued by up
to N tokens (greedy, or sampled with the model's generation_config settings from a
generator seeded by the request's seed and the row's index, so a restarted chunk draws the
same), padded with -1 after the first of the model's end tokens (generation_config.json's
`eos_token_id`, all of them, as `generate` stops at each).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = -1  # a prediction row's position past its end (input ids and generated tokens)


def score(model, ids: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: mean log-likelihood of each row's tokens after the first, and their count
    (NaN and 0 for a row of one token: nothing was predicted, so no score, not a perfect
    0.0). Right padding never changes an earlier position's logits (causal attention)."""
    ids = ids.long()
    valid = ids[:, 1:] >= 0
    logits = model(ids.clamp(min=0)).float()[:, :-1]
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].clamp(min=0).unsqueeze(-1))[..., 0]
    n = valid.sum(dim=1)
    mean = torch.where(n > 0, (logp * valid).sum(dim=1) / n.clamp(min=1), float("nan"))
    return torch.stack([mean, n.to(mean.dtype)], dim=1)


def _ends(eos) -> list[int]:
    """A request's end tokens: a list (an int, as requests written before it said)."""
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(i) for i in eos]


def _cut(out: torch.Tensor, made: torch.Tensor, ends: list[int]) -> None:
    """`out` (one row) holds `made` up to and with its first end token, -1 after it."""
    stop = torch.isin(made, torch.tensor(ends, dtype=made.dtype)).nonzero() if ends else []
    keep = int(stop[0]) + 1 if len(stop) else len(made)
    out[:keep] = made[:keep].float()
    out[keep:] = PAD


def generate(model, ids: torch.Tensor, new_tokens: int, seed, first_row: int,
             eos) -> torch.Tensor:
    """[rows, new_tokens]: each row's continuation (one row at a time: rows differ in length),
    -1 after the first of the end tokens (`eos`: the model's generation_config's)."""
    out = torch.full((len(ids), new_tokens), PAD, dtype=torch.float32)
    ends = _ends(eos)
    for i, row in enumerate(ids.long()):
        prompt = row[row >= 0][None]
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=0,
                      eos_token_id=ends or None, pad_token_id=ends[0] if ends else None,
                      do_sample=seed is not None)
        if seed is not None:
            torch.manual_seed(int(seed) * 1_000_003 + first_row + i)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        _cut(out[i], model.lm.generate(prompt, **kwargs)[0, prompt.shape[1]:], ends)
    return out


def generate_in_step(model, ids: torch.Tensor, new_tokens: int, eos) -> torch.Tensor:
    """Greedy continuation by full forwards, every row exactly `new_tokens` of them whatever
    it draws (a sharded model's forwards are collectives: every rank must run as many);
    -1 after the first end token, as `generate` writes."""
    out = torch.full((len(ids), new_tokens), PAD, dtype=torch.float32)
    for i, row in enumerate(ids.long()):
        cur = row[row >= 0][None]
        for _ in range(new_tokens):
            nxt = model(cur)[0, -1].argmax()
            cur = torch.cat([cur, nxt.view(1, 1)], dim=1)
        _cut(out[i], cur[0, -new_tokens:], _ends(eos))
    return out
