"""A third model kind, defined here and nowhere else (issue 41): `model.name:
toy_kind:BagOfTokens` names it, and train, predict, collect, doctor, plan and export ask it
what they need. It is a bag-of-tokens classifier: integer token ids in (its `input_dtype`
keeps them integers from the memmap to the embedding), class logits out when training,
class probabilities from `predict` (its own prediction, not the forward's logits)."""
from __future__ import annotations

import torch
from torch import nn

from enn_cluster.models.kinds import ModelKind


class Bag(nn.Module):
    input_dtype = torch.long

    def __init__(self, vocab: int, width: int, n_classes: int):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, width, mode="mean")
        self.head = nn.Linear(width, n_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids.long()))

    def init_weights(self) -> None:
        """Seeded by the run (meta_init: every rank initialises its own shards)."""
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.zeros_(self.head.bias)
        nn.init.normal_(self.head.weight, std=0.1)


class BagOfTokens(ModelKind):
    name = "bag-of-tokens"
    compares_fp32 = False

    def build(self, cfg, input_shape, n_outputs):
        return Bag(int(cfg.model.kwargs.get("vocab", 64)), cfg.model.d_model, n_outputs)

    def predict(self, model, xb, request, first_row, sharded=False):
        return torch.softmax(model(xb).float(), dim=-1)

    def describe(self, cfg, model, input_shape):
        return f"a bag of {input_shape[0]} tokens into {model.head.out_features} classes"
