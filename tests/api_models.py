"""Models for API tests: importable by path, as models shipped to workers must be."""
import torch
from torch import nn


class TinyRegressor(nn.Module):
    def __init__(self, n_in: int = 8, hidden: int = 16, n_out: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, n_out)

    def forward(self, x):
        return self.head(self.body(x))


def preset(value: float = 0.01) -> TinyRegressor:
    """A 'pretrained' model: every weight set to a known pattern."""
    model = TinyRegressor()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.full_like(p, value * (i + 1)))
    return model


def tiny(n_features: int, n_outputs: int) -> TinyRegressor:
    """The `module:factory` form: the runtime passes the data's input/output sizes."""
    return TinyRegressor(n_features, 16, n_outputs)


class ConstantRegressor(nn.Module):
    """Outputs one learned value whatever the input: the prediction-collapse case."""

    def __init__(self, n_outputs: int):
        super().__init__()
        self.value = nn.Parameter(torch.zeros(n_outputs))

    def forward(self, x):
        return self.value.expand(len(x), -1) + 0.0 * x[:, :1]


def constant(n_features: int, n_outputs: int) -> ConstantRegressor:
    return ConstantRegressor(n_outputs)


class BranchyRegressor(TinyRegressor):
    """Trains and predicts fine, but branches in Python on a tensor's value: not export-safe."""

    def forward(self, x):
        if x.mean() > 100.0:  # data-dependent: torch.export cannot trace this branch
            return self.head(self.body(x)) * 0.0
        return self.head(self.body(x))


def branchy(n_features: int, n_outputs: int) -> BranchyRegressor:
    return BranchyRegressor(n_features, 16, n_outputs)
