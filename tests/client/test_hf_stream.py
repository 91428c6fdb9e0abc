"""The pure pieces of the streamed `--format hf` export (client/hf_stream.py): shards cut
as huggingface_hub cuts them, save_pretrained's file names, a safetensors file written
header first then tensor by tensor that safetensors reads back, the base's dtype."""
from __future__ import annotations

import json

import pytest
import torch

from enn_cluster.client.hf_stream import Entry, base_dtype, pack, shard_files, write_shard


@pytest.mark.parametrize("sizes,budget", [([5, 5, 5, 5], 10), ([3, 20, 3, 3, 9], 10),
                                          ([1], 10), ([11, 11], 10), ([4, 4, 4], 12)])
def test_shards_are_cut_as_huggingface_hub_cuts_them(sizes, budget):
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"t{i}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    theirs = split_torch_state_dict_into_shards(state, max_shard_size=budget)
    ours = pack(sizes, budget)
    assert {file: [f"t{i}" for i in run] for file, run in zip(shard_files(len(ours)), ours)} \
        == theirs.filename_to_tensors


def test_a_file_streamed_header_first_reads_back_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a.weight": torch.randn(3, 5).to(torch.bfloat16), "b.bias": torch.randn(7),
               "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "d.scalar": torch.tensor(2.5, dtype=torch.float16),
               "e.empty": torch.empty(0, 4)}
    entries = [Entry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), "")
               for n, t in tensors.items()]
    write_shard(tmp_path / "x.safetensors", entries, lambda e: tensors[e.name])
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_tensor_that_reads_as_another_shape_is_refused(tmp_path):
    from enn_cluster.errors import UserError

    entry = Entry("w", "float32", (2, 2), "")
    with pytest.raises(UserError, match="w reads as"):
        write_shard(tmp_path / "x.safetensors", [entry], lambda e: torch.zeros(4))


@pytest.mark.parametrize("precision,want", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_the_base_dtype_is_what_the_folder_says(tmp_path, precision, want):
    from lm_support import tiny_model

    model = tiny_model(tmp_path, precision=precision)
    assert base_dtype(model) == want
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    assert base_dtype(model) == want  # from the safetensors headers
