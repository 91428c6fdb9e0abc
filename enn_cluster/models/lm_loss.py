"""The next-token loss of a causal LM, and the positions of packed rows. The loss is the
mean cross-entropy over the tokens a row learns: each label after the first that is not
IGNORE_INDEX (pads and prompt tokens are staged that way; the model shifts, staging does
not). Training computes it from the final hidden states chunk by chunk (`chunked_loss`),
each chunk's logits recomputed in the backward pass rather than kept: with a 128k
vocabulary the logits of one 8192-token row are 4.2 GB in fp32. Pure torch, no
transformers: the memory plan sizes the chunk with the same function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # a label the loss skips: pads and prompt tokens (staged that way)
LOSS_CHUNK_LOGITS = 1 << 26  # logits per chunk of the loss: 256 MiB in fp32


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over the counted tokens (0, not NaN, for a batch with none: it trains nothing)."""
    shifted = labels[:, 1:].long().reshape(-1)
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    total = F.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (shifted != IGNORE_INDEX).sum().clamp(min=1)


def learned_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens the loss averages over: every label after the first not IGNORE_INDEX."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def packed_positions(ids: torch.Tensor, document_end: int) -> torch.Tensor:
    """Position ids of rows of packed documents: counting from 0 at the row's start and
    after every `document_end`. transformers reads positions that restart as packed
    sequences when no attention mask is given (masking_utils.find_packed_sequence_indices)
    and lets a token attend only within its own, as TRL's padding-free collator relies on."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., :-1] == document_end
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the loss, so that a chunk's logits are LOSS_CHUNK_LOGITS (pure)."""
    return max(64, LOSS_CHUNK_LOGITS // max(vocab, 1))


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")


def chunked_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                 chunk: int) -> torch.Tensor:
    """next_token_loss(head(hidden), labels) with at most `chunk` tokens' logits alive at a
    time: each chunk is checkpointed, so its logits are made again in the backward pass
    (one more head matmul per token, ~2 % of a Llama-3-8B step) instead of kept."""
    from torch.utils.checkpoint import checkpoint

    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    shifted = labels[:, 1:].long().reshape(-1)
    sums = [checkpoint(_chunk_loss_sum, head, flat[start:start + chunk],
                       shifted[start:start + chunk], use_reentrant=False)
            for start in range(0, shifted.numel(), chunk)]
    total = sum(sums[1:], sums[0]) if sums else (flat.sum() * 0).float()  # a graph, always
    return total / (shifted != IGNORE_INDEX).sum().clamp(min=1)
