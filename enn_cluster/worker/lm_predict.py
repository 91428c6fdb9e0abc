"""A Hugging Face causal LM's weights for prediction: a whole replica per rank, or the model
sharded as in training (`--sharded`). What a prediction computes of each row (scores,
generated tokens) is the kind's (models/causal_lm.py: CausalLMKind.predict).

Each replica: the base weights read from the weights directory, the checkpoint's tensors
(all of them, or a LoRA run's adapters, then merged) on top, read by the first rank of each
node and handed to the node's other ranks (as predict_weights does).
"""
from __future__ import annotations

import logging

import torch

from enn_cluster.config.hf_name import weights_dir
from enn_cluster.models import kind_of
from enn_cluster.models.causal_lm import CausalLM
from enn_cluster.storage import base_weights
from enn_cluster.storage import commits as store
from enn_cluster.storage.dcp_io import safe_load
from enn_cluster.storage.model_structure import with_storage
from enn_cluster.worker import lm_weights
from enn_cluster.worker.lm_weights import frozen_base_identity
from enn_cluster.worker.predict_weights import fill, node_readers

log = logging.getLogger("enn_cluster.worker.predict")


@torch.no_grad()
def lm_replica(cfg, checkpoints, step: int, lanes, node: int, dtype: torch.dtype) -> CausalLM:
    """The model of step-N, whole on this rank, in `dtype`, LoRA merged (collective). The
    first rank of each node reads the base weights and the checkpoint; the node's other
    ranks receive every tensor from it (predict_weights.node_readers)."""
    from enn_cluster.storage.dcp_metadata import tensor_names

    from enn_cluster.worker.parallel import set_master_dtypes

    with torch.device("meta"):
        model = kind_of(cfg).build(cfg)
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
