"""FSDP units are found in the model itself (issue 24 section 2): a Hugging Face model's
decoder layers (`_no_split_modules`), wherever a user's wrapper puts it, else the largest
ModuleList of one class; and a user's wrapped LM trained through the API predicts without
crashing although its outputs ([tokens, vocab] per row) are not shaped like its targets."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import enn_cluster
from enn_cluster.models import model_blocks, repeated_blocks
from lm_support import packed_tokens, tiny_model


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


def test_a_wrapped_lm_trains_on_2_ranks_and_predicts_its_logits(tmp_path):
    path = tiny_model(tmp_path)
    x = packed_tokens(path, 16, 16)
    run = enn_cluster.train("api_models:wrapped_llm", x, x, run_dir=str(tmp_path / "r"),
                            config={"model": {"kwargs": {"path": str(path)}}},
                            training={"max_steps": 2, "per_device_train_batch_size": 4},
                            parallel={"nodes": 1, "procs_per_node": 2})
    assert run.latest_checkpoint == 2
    logits = enn_cluster.predict(run, x[:3])
    model = run.load_model()
    with torch.no_grad():
        expect = model(torch.from_numpy(x[:3]))
    assert logits.shape == tuple(expect.shape) == (3, 16, model.inner.config.vocab_size)
    np.testing.assert_allclose(logits, expect.numpy(), rtol=1e-5, atol=1e-5)
