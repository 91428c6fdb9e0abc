"""Prediction with a Hugging Face causal LM: per-row scores, or generated tokens.

Input rows are token ids right-padded with -1 (staged so by the client from text, or given
as an array). A row's score is the mean log-likelihood of its tokens after the first and
their count (`[mean_logprob, n]`); with `generate` the row's prompt is continued by up to
N tokens (greedy, or sampled from a generator seeded by the request's seed and the row's
index, so a restarted chunk draws the same), padded with -1 after the end-of-sequence token.

Each rank holds a whole replica: the base weights read from the weights directory, the
checkpoint's tensors (all of them, or a LoRA run's adapters, then merged) on top.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from enn_cluster.config.hf_name import weights_dir
from enn_cluster.models.causal_lm import CausalLM, build_causal_lm
from enn_cluster.storage import base_weights
from enn_cluster.storage import commits as store
from enn_cluster.storage.dcp_io import safe_load
from enn_cluster.storage.model_structure import with_storage
from enn_cluster.worker import lm_weights

log = logging.getLogger("enn_cluster.worker.predict")
PAD = -1  # a position past the row's end


def lm_replica(cfg, checkpoints, step: int, lanes, dtype: torch.dtype) -> CausalLM:
    """The model of step-N, whole on this rank, in `dtype`, LoRA merged (collective)."""
    from torch.distributed.checkpoint import FileSystemReader

    with torch.device("meta"):
        model = build_causal_lm(cfg)
    with_storage(model, lanes.device)
    path = store.step_dir(checkpoints, step)
    lm_weights.initialize(model, weights_dir(cfg.model.name), cfg.training.seed, lanes.control)
    if model.has_lora:
        saved = base_weights.identity(weights_dir(cfg.model.name))
        base_weights.check_same_base(store.read_commit(path).get("base_weights"), saved, step)
    held = {k.removeprefix("model.") for k in FileSystemReader(str(path)).read_metadata()
            .state_dict_metadata if k.startswith("model.")}
    state = {k: v for k, v in model.state_dict().items() if k in held}
    safe_load({"model": state}, path, process_group=lanes.control)
    if model.has_lora:
        model = CausalLM(model.lm.merge_and_unload())
    log.info("LM replica of step-%d: %d tensors from the checkpoint, the rest from %s",
             step, len(state), weights_dir(cfg.model.name))
    return model.to(dtype).eval()


def score(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: mean log-likelihood of each row's tokens after the first, and their count.
    Right padding never changes an earlier position's logits (causal attention)."""
    ids = ids.long()
    valid = ids[:, 1:] >= 0
    logits = model(ids.clamp(min=0)).float()[:, :-1]
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].clamp(min=0).unsqueeze(-1))[..., 0]
    n = valid.sum(dim=1)
    mean = (logp * valid).sum(dim=1) / n.clamp(min=1)
    return torch.stack([mean, n.to(mean.dtype)], dim=1)


def generate(model: CausalLM, ids: torch.Tensor, new_tokens: int, seed, first_row: int,
             eos_id) -> torch.Tensor:
    """[rows, new_tokens]: each row's continuation (one row at a time: rows differ in length),
    -1 after the end-of-sequence token."""
    out = torch.full((len(ids), new_tokens), PAD, dtype=torch.float32)
    for i, row in enumerate(ids.long()):
        prompt = row[row >= 0][None]
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=0, pad_token_id=eos_id,
                      do_sample=seed is not None)
        if seed is not None:
            torch.manual_seed(int(seed) * 1_000_003 + first_row + i)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        made = model.lm.generate(prompt, **kwargs)[0, prompt.shape[1]:]
        stop = (made == eos_id).nonzero()
        keep = int(stop[0]) + 1 if len(stop) and eos_id is not None else len(made)
        out[i, :keep] = made[:keep].float()
    return out
