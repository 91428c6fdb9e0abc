"""FSDP units are found in the model itself (issue 24 section 2): a Hugging Face model's
decoder layers (`_no_split_modules`), wherever a user's wrapper puts it, else the largest
ModuleList of one class; and a user's wrapped LM trained through the API predicts without
crashing although its outputs ([tokens, vocab] per row) are not shaped like its targets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import enn_cluster
from enn_cluster.models import model_blocks, repeated_blocks
from lm_support import PRECISIONS, bf16_training, packed_tokens, tiny_model


def test_a_wrapped_hf_model_is_sharded_per_decoder_layer(tmp_path):
    from api_models import WrappedCausalLM

    model = WrappedCausalLM(str(tiny_model(tmp_path)))
    blocks = model_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 4
    assert blocks == list(model.inner.model.layers)


def test_repeated_layers_are_found_without_blocks_or_hf_hints():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.big = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
            self.mixed = nn.ModuleList([nn.Linear(128, 128), nn.ReLU()])
            self.head = nn.Linear(64, 1)

    net = Net()
    assert repeated_blocks(net) == list(net.big)
    flat = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    assert repeated_blocks(flat) == [] and model_blocks(flat) == list(flat)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_wrapped_lm_trains_on_2_ranks_and_predicts_its_logits(tmp_path, precision):
    """In bf16 (a bf16 checkpoint, ids above 4000) the ids reach the user's module as
    integers (its input_dtype), in training and prediction, and the logits agree with the
    loaded model's own forward in bf16."""
    path = tiny_model(tmp_path, precision=precision)
    x = packed_tokens(path, 16, 16)
    run = enn_cluster.train("api_models:wrapped_llm", x, x, run_dir=str(tmp_path / "r"),
                            config={"model": {"kwargs": {"path": str(path)}}},
                            training={"max_steps": 2, "per_device_train_batch_size": 4,
                                      **bf16_training(precision)},
                            parallel={"nodes": 1, "procs_per_node": 2})
    assert run.latest_checkpoint == 2
    logits = enn_cluster.predict(run, x[:3])
    model = run.load_model()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.no_grad():
        expect = model.to(dtype)(torch.from_numpy(x[:3])).float()
    assert logits.shape == tuple(expect.shape) == (3, 16, model.inner.config.vocab_size)
    tol = 1e-5 if precision == "fp32" else 0.0  # the same bf16 weights, the same forward
    np.testing.assert_allclose(logits, expect.numpy(), rtol=tol, atol=tol)


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_token_ids_reach_the_embedding_unrounded_under_bf16(tmp_path, world_of_one):
    """Issue 36 section 1: a bf16 model's ids (all above 4000, where bf16 holds only every
    16th integer) go from the staged int32 memmap through the trainer's gather_rows and
    FSDP2's bf16 mixed precision (which casts floating inputs) to the embedding as
    integers: the logits equal transformers' own bf16 forward of the same ids, and the
    master weights are fp32 although config.json says bfloat16."""
    from transformers import AutoModelForCausalLM
    from torch.distributed.device_mesh import init_device_mesh

    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.models import input_dtype
    from enn_cluster.models.causal_lm import CausalLM
    from enn_cluster.worker.loader import gather_rows
    from enn_cluster.worker.parallel import set_master_dtypes, wrap_model

    path = tiny_model(tmp_path, precision="bf16")
    ids = packed_tokens(path, 4, 16)
    assert ids.min() > 4000
    np.save(tmp_path / "x.npy", ids)
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    model = CausalLM(AutoModelForCausalLM.from_pretrained(str(path)))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # as config.json says
    set_master_dtypes(model, use_bf16=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # every one trains
    plan = MeshPlan("fsdp", 1, 1)
    model = wrap_model(model, plan, init_device_mesh("cpu", (1,)), torch.device("cpu"),
                       use_bf16=True)
    xb, _ = gather_rows(x, x, np.arange(4), None, dtype=input_dtype(model))
    assert not xb.is_floating_point()
    with torch.no_grad():
        ours = model(xb)
        theirs = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.bfloat16)(input_ids=torch.from_numpy(ids).long()).logits
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=0)


def test_prediction_rows_are_token_ids_and_floats_only_when_whole():
    from enn_cluster.errors import UserError
    from enn_cluster.worker.loader import host_rows

    ids = np.array([[4001, 4433, -1]], np.int32)
    assert host_rows(ids, torch.long).dtype == np.int64
    assert host_rows(ids, torch.long).tolist() == ids.tolist()
    assert host_rows(ids.astype(np.float64), torch.long).tolist() == ids.tolist()
    assert host_rows(ids, torch.float32).dtype == np.float32
    with pytest.raises(UserError, match="--input: .*whole numbers"):
        host_rows(np.array([[4001.5, 2.0]]), torch.long)
    with pytest.raises(UserError):
        host_rows(np.array([[np.nan, 2.0]]), torch.long)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fsdp_units_the_embedding_alone_and_the_last_layer_kept_gathered(tmp_path, arch,
                                                                          precision,
                                                                          world_of_one):
    """Issue 39 section 3 (FSDP units), on by default: an untied causal LM's token embedding
    is a unit of its own (the root would hold it whole all step), a tied one (Qwen2's small
    models: the head is the same weight) stays with the root; after a training forward
    every unit is sharded again except the last decoder layer, which the backward needs
    first. The loss and gradients equal those of the model sharded the old way (blocks
    alone). In bf16 (a model saved in bf16, ids above 4000) the masters stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.models.causal_lm import CausalLM
    from enn_cluster.worker.parallel import mixed_precision, set_master_dtypes, wrap_model

    bf16 = precision == "bf16"
    path = tiny_model(tmp_path, arch, precision)
    ids = torch.from_numpy(packed_tokens(path, 4, 16)).long()
    mesh = init_device_mesh("cpu", (1,))

    def built():
        torch.manual_seed(0)
        model = CausalLM(AutoModelForCausalLM.from_pretrained(str(path)))
        set_master_dtypes(model, bf16)
        return model

    ours = wrap_model(built(), MeshPlan("fsdp", 1, 1), mesh, torch.device("cpu"), use_bf16=bf16)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    embedding, layers = ours.base().get_input_embeddings(), ours.blocks()
    tied = ours.base().config.tie_word_embeddings
    assert isinstance(embedding, FSDPModule) != tied
    assert all(isinstance(layer, FSDPModule) for layer in layers)
    loss = ours(ids, labels=ids)
    gathered = [not isinstance(next(m.parameters()), DTensor) for m in [embedding, *layers]]
    assert gathered == [tied] + [False] * (len(layers) - 1) + [True]  # the root keeps a tied one gathered
    loss.backward()

    old = built()
    policy = {"mp_policy": mixed_precision(True)} if bf16 else {}
    for layer in old.blocks():
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(old, mesh=mesh, **policy)
    old_loss = old(ids, labels=ids)
    old_loss.backward()
    assert loss.item() == old_loss.item()
    for (name, a), (_, b) in zip(ours.named_parameters(), old.named_parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=0, atol=0,
                                   msg=name)
