"""parallel.activation_checkpointing on a real decoder (issue 39 section 3): `selective` is
torch's per-op selective checkpointing (attention and every other matmul output kept, the
cheap ops recomputed), `every_other` checkpoints every other block whole, `full` every block.
What each recomputes is counted from the ops the backward pass runs; whatever is recomputed,
the gradients are the ones without checkpointing, bit for bit, and the parameters keep their
names (checkpoints and safetensors names do not change)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from enn_cluster.models.causal_lm import CausalLM
from enn_cluster.worker.parallel import checkpointed_blocks, prepare_blocks
from lm_support import PRECISIONS, tiny_model

MODES = ("none", "selective", "every_other", "full")


class _OpCount(TorchDispatchMode):
    """How many matmuls and attention kernels ran while it was on."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        self.matmuls += func in (aten.mm.default, aten.addmm.default, aten.bmm.default)
        self.attention += "scaled_dot_product" in str(func)
        return func(*args, **(kwargs or {}))


def _backward(path, precision, mode):
    """(gradients, the backward pass's op counts) of one step under `mode`."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = CausalLM(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))
    names = [n for n, _ in model.named_parameters()]
    prepare_blocks(model.blocks(), mode)
    assert [n for n, _ in model.named_parameters()] == names
    vocab = model.base().config.vocab_size
    ids = torch.randint(vocab - 300, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    model.train()
    loss = model(ids, labels=ids)
    count = _OpCount()
    with count:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, count


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_mode_recomputes_its_share_and_the_gradients_stay_bit_identical(tmp_path,
                                                                             precision):
    path = tiny_model(tmp_path, "llama", precision)
    runs = {mode: _backward(path, precision, mode) for mode in MODES}
    want = runs["none"][0]
    for mode, (got, _) in runs.items():
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (mode, name)
    none, sel, other, full = (runs[m][1] for m in MODES)
    # full recomputes every block's forward matmuls; every other block half of them
    assert full.matmuls > other.matmuls > none.matmuls
    assert full.matmuls - none.matmuls == 2 * (other.matmuls - none.matmuls)
    # selective: some matmuls recomputed in every block (every other of each part's),
    # the attention never
    assert none.matmuls < sel.matmuls < full.matmuls
    assert sel.attention == none.attention < full.attention


def test_which_blocks_each_mode_checkpoints():
    blocks = list(range(5))
    assert checkpointed_blocks(blocks, "none") == []
    assert checkpointed_blocks(blocks, "every_other") == [0, 2, 4]
    assert checkpointed_blocks(blocks, "full") == checkpointed_blocks(blocks, "selective") == blocks


@pytest.mark.slow  # inductor compiles each decoder layer on the CPU: about 20 s a mode
@pytest.mark.parametrize("mode", ["selective", "every_other"])
def test_compiled_blocks_checkpoint_as_eager_ones_do(tmp_path, mode):
    """training.compile with checkpointing (the device check's default, selective): the
    compiled blocks' backward gets the eager gradients. Under the composable checkpoint's
    hooks, selective failed at the first backward ("aten.mm encountered during backward,
    but not found in storage", first seen on an H200): the compiled forward stored nothing
    for the eager recompute's policy."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(tmp_path, "llama")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))

    def grads(checkpointing: str, compiled: bool) -> dict:
        model = CausalLM(AutoModelForCausalLM.from_pretrained(str(path)))
        prepare_blocks(model.blocks(), checkpointing, compile_blocks=compiled)
        model(ids, labels=ids).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want, got = grads("none", False), grads(mode, True)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
