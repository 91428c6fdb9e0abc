"""The causal LM's training loss never holds the whole logits (issue 39 section 3): the LM
head and the cross-entropy run chunk by chunk, each chunk's logits made again in the
backward pass. Held to transformers' own loss and to the full-logits loss, with gradients,
on a tiny Llama saved in fp32 and one saved in bf16 (ids above 4000)."""
from __future__ import annotations

import pytest
import torch

from enn_cluster.models import lm_loss
from enn_cluster.models.causal_lm import CausalLM
from enn_cluster.models.lm_loss import IGNORE_INDEX, chunked_loss
from lm_support import PRECISIONS, tiny_model


def _model(tmp_path, precision):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tiny_model(tmp_path, precision=precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return CausalLM(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))


def _ids(model, rows=3, length=24):
    vocab = model.base().config.vocab_size
    ids = torch.randint(vocab - 200, vocab, (rows, length))  # ids well past 256 (and 4000)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # a prompt: not learned
    labels[-1, -4:] = IGNORE_INDEX  # padding
    return ids, labels


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_chunked_loss_equals_the_full_logits_loss_and_its_gradients(tmp_path, precision):
    model = _model(tmp_path, precision)
    ids, labels = _ids(model)
    assert model.loss_in_forward  # a Llama: the logits are the head's output alone
    full = CausalLM.loss(model(ids), labels)
    full.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    base = model.base()
    hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    chunked = chunked_loss(hidden, base.get_output_embeddings(), labels, chunk=7)
    chunked.backward()
    got = _grads(model)
    tol = 1e-6 if precision == "fp32" else 2e-3
    assert abs(chunked.item() - full.item()) <= tol * abs(full.item()), (chunked, full)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item() + 1e-12
        assert (got[name] - want[name]).abs().max().item() <= 10 * tol * scale, name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_head_never_sees_more_than_a_chunk_and_the_loss_is_transformers_own(
        tmp_path, precision, monkeypatch):
    model = _model(tmp_path, precision)
    vocab = model.base().config.vocab_size
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_LOGITS", 10 * vocab)  # 64 tokens a chunk
    ids, labels = _ids(model, rows=4, length=48)  # 188 shifted tokens: 3 chunks
    seen = []
    head = model.base().get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    loss = model(ids, labels)
    loss.backward()  # the chunks' logits made again
    hook.remove()
    rows = [shape[0] for shape in seen]
    assert max(rows) <= 64 and len(rows) == 6, seen  # 3 forward, 3 recomputed; never 4 x 48
    with torch.no_grad():
        own = model.lm(input_ids=ids, labels=labels, use_cache=False).loss
    tol = 1e-6 if precision == "fp32" else 2e-3
    assert abs(loss.item() - own.item()) <= tol * abs(own.item()), (loss, own)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ["granite", "cohere", "gemma2", "gpt2"])
def test_heads_that_scale_or_cap_their_logits_give_transformers_own_loss(tmp_path, arch,
                                                                          precision):
    """Granite-3 divides its logits by logits_scaling (8 here, as granite-3.0-2b), Cohere
    multiplies them by logit_scale, Gemma 2 soft-caps them, GPT-2's head is not chunked:
    the training loss is transformers' own whichever path it takes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tiny_model(tmp_path, arch, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = CausalLM(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))
    ids, labels = _ids(model)
    with torch.no_grad():
        ours = model(ids, labels)
        own = model.lm(input_ids=ids, labels=labels, use_cache=False).loss
    tol = 1e-6 if precision == "fp32" else 2e-3
    assert abs(ours.item() - own.item()) <= tol * abs(own.item()), (ours, own)


def test_a_row_with_nothing_to_learn_gives_zero_and_a_graph(tmp_path):
    model = _model(tmp_path, "fp32")
    ids, _ = _ids(model, rows=2, length=8)
    labels = torch.full_like(ids, IGNORE_INDEX)
    loss = model(ids, labels)
    loss.backward()  # trains nothing, and does not fail
    assert loss.item() == 0.0
    one = model(ids[:, :1], ids[:, :1])  # one token: no next token to predict
    one.backward()
    assert one.item() == 0.0


def test_a_head_that_is_more_than_a_linear_layer_keeps_the_logits(tmp_path):
    """Gemma 2 soft-caps its logits in its forward: the chunked loss would skip that, so
    such a model computes its loss from the logits it returns."""
    model = _model(tmp_path, "fp32")
    ids, labels = _ids(model)
    model.base().config.final_logit_softcapping = 30.0
    assert not model.loss_in_forward
    assert torch.equal(model(ids, labels), CausalLM.loss(model(ids), labels))
