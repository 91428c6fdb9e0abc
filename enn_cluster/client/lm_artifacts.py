"""A causal LM's checkpoint as Hugging Face artifacts, in this process.

- `load_lm`: the whole model on the CPU: the base from the weights directory (transformers'
  `from_pretrained`), the checkpoint's tensors on top (every weight of a full fine-tune, the
  adapters of a LoRA run, whose base must be the one it trained on).
- `--format hf`: a directory `AutoModelForCausalLM.from_pretrained` loads (LoRA merged), with
  the tokenizer, streamed tensor by tensor in the base's dtype (client/hf_stream.py: the
  whole model is never built); `--format peft`: the adapters alone, for
  `PeftModel.from_pretrained` over the base, written by peft's own `save_pretrained`.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

from enn_cluster.client import hf_stream
from enn_cluster.client.hf_stream import check_held
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError
from enn_cluster.config.hf_name import weights_dir
from enn_cluster.models.causal_lm import CausalLM
from enn_cluster.storage.base_weights import check_step_base
from enn_cluster.storage.dcp_io import safe_load
from enn_cluster.storage.dcp_metadata import tensor_names
from enn_cluster.storage.text_sources import check_same_tokenizer, tokenizer_dir


def load_lm(cfg: RunConfig, step_dir: Path, merge: bool = True) -> CausalLM:
    """The model of a checkpoint, whole, fp32, on the CPU, in eval mode; LoRA merged into the
    weights unless `merge` is False (then still a peft model)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per command, not a bar per load

    from enn_cluster.models.causal_lm import with_lora

    path = weights_dir(cfg.model.name)
    try:
        lm = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                  dtype=torch.float32, trust_remote_code=False)
    except (OSError, ValueError) as exc:  # transformers' refusals: one line, never a trace
        raise UserError(f"model.name: the weights in {path} do not load ({str(exc).splitlines()[0][:200]}); "
                        "point hf: at the directory save_pretrained wrote") from None
    if cfg.lora.enabled:
        check_step_base(step_dir, path)
        lm = with_lora(lm, cfg.lora)
    model = CausalLM(lm)
    held = tensor_names(step_dir, "model.")  # through the allow-list, never plain pickle
    check_held(model, held, cfg.lora.enabled, step_dir)
    state = {k: v for k, v in model.state_dict().items() if k in held}
    with warnings.catch_warnings():  # DCP's note that it loads in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load({"model": state}, step_dir)
    model.load_state_dict(state, strict=False)
    if cfg.lora.enabled and merge:
        model = CausalLM(model.lm.merge_and_unload())
    return model.eval()


def write_hf(cfg: RunConfig, step_dir: Path, out: Path, fmt: str,
             staged_text: Optional[dict] = None, dtype: Optional[str] = None,
             shard_bytes: Optional[int] = None) -> None:
    """Write `fmt` ("hf", streamed in `dtype`, the base's by default, in shards of at most
    `shard_bytes`; or "peft") into the new directory `out`."""
    from transformers import AutoTokenizer

    if fmt == "peft" and not cfg.lora.enabled:
        raise UserError("peft writes LoRA adapters, and this run fine-tuned every weight "
                        "(lora.r: 0)", field=INPUTS["format"], value=fmt,
                        fix="use {hf}", hf=Said(INPUTS["format"], "hf"))
    check_same_tokenizer(staged_text, cfg.data, cfg.model)  # exported beside the model
    if fmt == "hf":
        hf_stream.write_streamed(cfg, step_dir, out, dtype, shard_bytes or hf_stream.SHARD_BYTES)
    else:  # the adapters (small) in fp32, as peft keeps them over any base
        load_lm(cfg, step_dir, merge=False).lm.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(cfg.data, cfg.model)[1]),
                                        local_files_only=True, trust_remote_code=False)
    tok.save_pretrained(str(out))
