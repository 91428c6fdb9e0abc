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


class OffsetRegressor(nn.Module):
    """Varies by up to 150 around 99840: fp32 shows it; bf16, whose steps are 512 apart
    there (8 significant bits), rounds every output to 99840."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.offset = nn.Parameter(torch.full((n_out,), 99840.0))
        self.scale = nn.Parameter(torch.full((n_out,), 150.0))
        with torch.no_grad():
            self.lin.weight.mul_(20.0)  # tanh saturates: outputs near 99840 +- 150

    def forward(self, x):
        return self.offset + self.scale * torch.tanh(self.lin(x))


def offset(n_features: int, n_outputs: int) -> OffsetRegressor:
    return OffsetRegressor(n_features, n_outputs)


class ScaledRegressor(nn.Module):
    """Holds a buffer its constructor computes and its state dict leaves out
    (persistent=False): no checkpoint restores it."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.linspace(1.0, 2.0, n_out), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


class ScaledOwnInit(ScaledRegressor):
    """The same with torchtitan's init_weights(), which computes the buffer again."""

    def init_weights(self):
        self.scale.copy_(torch.linspace(1.0, 2.0, len(self.scale)))
        self.lin.reset_parameters()


def scaled(n_features: int, n_outputs: int) -> ScaledRegressor:
    return ScaledRegressor(n_features, n_outputs)


def scaled_own_init(n_features: int, n_outputs: int) -> ScaledOwnInit:
    return ScaledOwnInit(n_features, n_outputs)


class NormedRegressor(nn.Module):
    """What a module shipped as its structure must keep: BatchNorm's running statistics
    (persistent buffers: in the step-0 checkpoint), dropout (the RNG) and a non-persistent
    buffer (in no checkpoint: shipped with the structure)."""

    def __init__(self, n_in: int = 8, hidden: int = 16, n_out: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.BatchNorm1d(hidden), nn.Tanh(),
                                  nn.Dropout(0.2))
        self.head = nn.Linear(hidden, n_out)
        self.register_buffer("input_scale", torch.linspace(0.5, 1.5, n_in), persistent=False)

    def forward(self, x):
        return self.head(self.body(x * self.input_scale))


def normed_preset() -> NormedRegressor:
    """A 'pretrained' NormedRegressor: seeded weights, running statistics of its own."""
    torch.manual_seed(3)
    model = NormedRegressor()
    norm = model.body[1]
    with torch.no_grad():
        norm.running_mean.copy_(torch.linspace(-0.5, 0.5, 16))
        norm.running_var.fill_(2.0)
        norm.num_batches_tracked.fill_(5)
    return model


def normed_zero_head(n_features: int, n_outputs: int) -> NormedRegressor:
    """A user factory with BatchNorm buffers and an init of its own in code (a zeroed
    head): built whole, never re-initialised by the built-ins' per-module rules."""
    model = NormedRegressor(n_features, 16, n_outputs)
    nn.init.zeros_(model.head.weight)
    return model


class TiedRegressor(nn.Module):
    """Two names for one weight (a decoder tied to its encoder, as language models tie
    their embedding and head): a checkpoint holds both keys, the module one tensor."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.enc = nn.Linear(n_in, n_in, bias=False)
        self.dec = nn.Linear(n_in, n_in, bias=False)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


def tied(n_features: int, n_outputs: int) -> TiedRegressor:
    return TiedRegressor(n_features, n_outputs)


class WrappedCausalLM(nn.Module):
    """A user's own wrapper around a transformers causal LM (no blocks(), no init_weights):
    the issue-24 case whose decoder layers must still be FSDP units of their own. Its
    `input_dtype` says it takes token ids: they reach it as integers (models.input_dtype)."""

    input_dtype = torch.long

    def __init__(self, path: str):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.inner = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)

    def forward(self, ids):
        return self.inner(input_ids=ids.long(), use_cache=False).logits

    def loss(self, logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].long().reshape(-1))


def wrapped_llm(n_features: int, n_outputs: int, path: str) -> WrappedCausalLM:
    return WrappedCausalLM(path)


def not_a_module(n_features: int, n_outputs: int) -> dict:
    """A factory that returns weights, not a module (refused before anything is written)."""
    return {"weight": [[0.0] * n_features] * n_outputs}


def sized(n_features: int, n_outputs: int, width: int = 8) -> TinyRegressor:
    """A factory with a keyword of its own (model.kwargs: {width: N})."""
    return TinyRegressor(n_features, width, n_outputs)


def meta_refusing(n_features: int, n_outputs: int) -> TinyRegressor:
    """Like a factory that calls from_pretrained: it reads its weights' values, which the
    meta device has none of (its workers build it whole)."""
    model = TinyRegressor(n_features, 16, n_outputs)
    float(model.head.bias.detach().sum())  # fails on the meta device
    return model
