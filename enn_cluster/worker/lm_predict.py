"""Prediction with a Hugging Face causal LM: per-row scores, or generated tokens.

Input rows are token ids right-padded with -1 (staged so by the client from text, or given
as an array). A row's score is the mean log-likelihood of its tokens after the first and
their count (`[mean_logprob, n]`); with `generate` the row's prompt is continued by up to
N tokens (greedy, or sampled from a generator seeded by the request's seed and the row's
index, so a restarted chunk draws the same), padded with -1 after the end-of-sequence token.

Each rank holds a whole replica: the base weights read from the weights directory, the
checkpoint's tensors (all of them, or a LoRA run's adapters, then merged) on top, read by
the first rank of each node and handed to the node's other ranks (as predict_weights does).
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
from enn_cluster.worker.lm_weights import frozen_base_identity
from enn_cluster.worker.predict_weights import fill, node_readers

log = logging.getLogger("enn_cluster.worker.predict")
PAD = -1  # a position past the row's end


@torch.no_grad()
def lm_replica(cfg, checkpoints, step: int, lanes, node: int, dtype: torch.dtype) -> CausalLM:
    """The model of step-N, whole on this rank, in `dtype`, LoRA merged (collective). The
    first rank of each node reads the base weights and the checkpoint; the node's other
    ranks receive every tensor from it (predict_weights.node_readers)."""
    from enn_cluster.storage.dcp_metadata import tensor_names

    from enn_cluster.worker.parallel import set_master_dtypes

    with torch.device("meta"):
        model = build_causal_lm(cfg)
    # built in fp32 whatever config.json says: the fp32 weights a run trained are read as
    # they are, LoRA is merged in fp32, and the replica is cast to `dtype` once at the end
    # (the weights `export --format hf` loaded in that dtype has)
    set_master_dtypes(model, use_bf16=False)
    with_storage(model, lanes.device)
    path = store.step_dir(checkpoints, step)
    weights = weights_dir(cfg.model.name)
    _check_base(path, step, frozen_base_identity(cfg, model, lanes))
    lm_weights.init_computed(model, cfg.training.seed)  # buffers and adapters: every rank
    with node_readers(lanes, node, cfg) as (src, readers, group):
        state = model.state_dict()
        held = []
        if lanes.rank == src:
            lm_weights.load_base(model, weights, readers)
            held = sorted(tensor_names(path, "model."))  # the allow-list, never plain pickle
            safe_load({"model": {k: state[k] for k in held if k in state}}, path,
                      process_group=readers)
        fill(state, dict(state) if lanes.rank == src else None, src, group)
    if model.has_lora:
        model = CausalLM(model.lm.merge_and_unload())
    log.info("LM replica of step-%d: %s", step, f"{len(held)} tensors from the checkpoint, "
             f"the rest from {weights}" if lanes.rank == src else f"received from rank {src}")
    return model.to(dtype).eval()


def _check_base(path, step: int, base) -> None:
    """A LoRA checkpoint predicts only over the base weights it was trained on (every rank
    decides alike: `base` is rank 0's reading, broadcast)."""
    if base is not None:
        base_weights.check_same_base(store.read_commit(path).get("base_weights"), base, step)


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


def sharded_lm(cfg, run, chosen: int, env, lanes, input_shape: tuple):
    """The model of step-N sharded as in training (FSDP/HSDP per decoder layer: no rank holds
    it whole), for a model one device cannot hold; in eval mode. Collective."""
    from enn_cluster.storage.staging import read_manifest
    from enn_cluster.worker import checkpoint as ckpt
    from enn_cluster.worker.model_setup import build_sharded_model

    sm = build_sharded_model(cfg, read_manifest(run.data_dir), env, lanes, input_shape)
    ckpt.load(run.checkpoints, chosen, sm.model, None, lanes)
    _check_base(store.step_dir(run.checkpoints, chosen), chosen,
                frozen_base_identity(cfg, sm.model, lanes))
    log.info("LM of step-%d sharded over %d ranks (%s)", chosen, lanes.world_size,
             sm.plan.strategy)
    return sm.model.eval()


def generate_in_step(model, ids: torch.Tensor, new_tokens: int, eos_id) -> torch.Tensor:
    """Greedy continuation by full forwards, every row exactly `new_tokens` of them whatever
    it draws (a sharded model's forwards are collectives: every rank must run as many);
    -1 after the end-of-sequence token, as `generate` writes."""
    out = torch.full((len(ids), new_tokens), PAD, dtype=torch.float32)
    for i, row in enumerate(ids.long()):
        cur = row[row >= 0][None]
        for t in range(new_tokens):
            nxt = model(cur)[0, -1].argmax()
            out[i, t] = float(nxt)
            cur = torch.cat([cur, nxt.view(1, 1)], dim=1)
        stop = (out[i] == eos_id).nonzero() if eos_id is not None else []
        if len(stop):
            out[i, int(stop[0]) + 1:] = PAD
    return out


def forwards(request: dict, rows: int) -> int:
    """The forwards a sharded model runs for `rows` rows: one per batch to score them, one
    per new token per row to continue them."""
    gen = request.get("generate")
    if gen:
        return rows * int(gen["max_new_tokens"])
    return -(-rows // int(request["batch_size"]))


def idle_forwards(model, count: int, device) -> None:
    """The forwards a rank with fewer rows left runs so that its peers' collectives meet
    it (one row of two tokens; nothing is kept)."""
    dummy = torch.zeros((1, 2), dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(count):
            model(dummy)
