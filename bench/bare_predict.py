"""The baseline for the prediction benchmark: a plain single-process forward loop.

No enn_cluster code runs in the loop: torch's own DCP converter turns the run's newest
checkpoint into a state dict, a hand-built module with the MLP's layout loads it, and the
memmapped input goes through it batch by batch under `inference_mode` into one array,
saved as .npy and fsynced. The loop and the write are timed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _module(n_features: int, hidden: list[int], n_outputs: int):
    from torch import nn

    class Net(nn.Module):  # the parameter names of enn_cluster.models.MLP
        def __init__(self):
            super().__init__()
            sizes = [n_features, *hidden]
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(0.0))
                                        for a, b in zip(sizes[:-1], sizes[1:]))
            self.head = nn.Linear(sizes[-1], n_outputs)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Net()


def predict(run_dir: str, x_path: str, out_path: str, hidden_json: str, batch: int) -> dict:
    import numpy as np
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps = sorted(Path(run_dir, "checkpoints").glob("step-*"),
                   key=lambda p: int(p.name.split("-")[1]))
    full = Path(out_path).with_suffix(".pt")
    dcp_to_torch_save(str(steps[-1]), str(full))
    state = torch.load(full, weights_only=True)["model"]
    full.unlink()
    x = np.load(x_path, mmap_mode="r")
    model = _module(x.shape[1], json.loads(hidden_json), state["head.weight"].shape[0])
    model.load_state_dict(state)
    model.eval()
    out = np.empty((len(x), state["head.weight"].shape[0]), dtype=np.float32)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(x), batch):
            xb = torch.from_numpy(np.array(x[start:start + batch], dtype=np.float32))
            out[start:start + len(xb)] = model(xb).numpy()
    with open(out_path, "wb") as fh:
        np.save(fh, out)
        fh.flush()
        os.fsync(fh.fileno())
    return {"rows_per_s": len(x) / (time.perf_counter() - started)}
