"""The built-in models (an MLP, a small transformer over features) and what every model fed
arrays shares: building one by name (`build_model`: mlp, transformer or a user's
`module:factory`), the dtype its inputs travel in (`input_dtype`), and its loss
(`compute_loss`). A model may expose `blocks()`, the submodules FSDP shards one by one
(otherwise they are found: models.model_blocks), and may define `loss(outputs, targets)`;
otherwise the task's default loss is used. Imported on first use (torch): models/__init__.py
stays light for the client.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from enn_cluster.config.run_config import ModelConfig
from enn_cluster.errors import UserError
from enn_cluster.models.factory import import_factory


class MLP(nn.Module):
    def __init__(self, n_features: int, n_outputs: int, hidden_sizes=(64, 64), dropout=0.0):
        super().__init__()
        sizes = [n_features, *hidden_sizes]
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(dropout))
            for a, b in zip(sizes[:-1], sizes[1:]))
        self.head = nn.Linear(sizes[-1], n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


class FeatureTransformer(nn.Module):
    """Each input feature (or time step of a 3-D input) is a token; mean-pooled head."""

    def __init__(self, n_features: int, n_outputs: int, d_model=64, n_layers=2, n_heads=4,
                 dropout=0.0, n_tokens: int = 0, token_dim: int = 1):
        super().__init__()
        self.token_dim = token_dim
        self.embed = nn.Linear(token_dim, d_model)
        self.pos = nn.Parameter(torch.randn(n_tokens or n_features, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                       batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.unsqueeze(-1) if x.dim() == 2 else x
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(dim=1))

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


def build_model(cfg: ModelConfig, input_shape: tuple, n_outputs: int) -> nn.Module:
    """Build on the current default device (meta_init builds under torch.device("meta"))."""
    n_features = math.prod(int(d) for d in input_shape) if input_shape else 1
    if cfg.name == "mlp":
        return MLP(n_features, n_outputs, tuple(cfg.hidden_sizes), cfg.dropout)
    if cfg.name == "transformer":
        if len(input_shape) == 2:
            return FeatureTransformer(n_features, n_outputs, cfg.d_model, cfg.n_layers,
                                      cfg.n_heads, cfg.dropout, input_shape[0], input_shape[1])
        return FeatureTransformer(n_features, n_outputs, cfg.d_model, cfg.n_layers,
                                  cfg.n_heads, cfg.dropout)
    factory = import_factory(cfg.name)
    model = factory(n_features=n_features, n_outputs=n_outputs, **cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name: {cfg.name} returned {type(model).__name__}, not an nn.Module")
    return model


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module: DDP wraps it (FSDP2 shards it in place)."""
    return getattr(model, "module", model)


def input_dtype(model: nn.Module) -> torch.dtype:
    """What the model takes: token ids (a model whose `input_dtype` says an integer type,
    as CausalLM does) travel as integers from the memmap to its embedding; everything else
    gets float32 values. Pure."""
    inner = unwrapped(model)
    return getattr(inner, "input_dtype", torch.float32)


def model_loss(model: nn.Module, task: str, inputs: torch.Tensor, targets: torch.Tensor):
    """The loss of a batch: a model that computes it in its forward pass (a causal LM's
    chunked cross-entropy, which never holds the whole logits) is called with the labels;
    any other gives its outputs to compute_loss."""
    inner = unwrapped(model)
    if getattr(inner, "loss_in_forward", False):
        return model(inputs, labels=targets)
    return compute_loss(model, task, model(inputs), targets)


def loss_weight(model: nn.Module, targets: torch.Tensor):
    """What a batch's mean loss is a mean over, so that a step weighs each alike across
    micro-batches and ranks: a causal LM's learned tokens (rows differ in them: prompts,
    padding), else the rows."""
    inner = unwrapped(model)
    if hasattr(inner, "learned_tokens"):
        return inner.learned_tokens(targets)
    return float(targets.shape[0])


def compute_loss(model: nn.Module, task: str, outputs: torch.Tensor, targets: torch.Tensor):
    inner = unwrapped(model)
    if hasattr(inner, "loss"):
        return inner.loss(outputs, targets)
    if task == "classification":
        return F.cross_entropy(outputs.float(), targets.long().reshape(-1))
    return F.mse_loss(outputs.float(), targets.float().reshape(outputs.shape))
