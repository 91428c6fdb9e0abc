"""The config-validation decision of docs/architecture.md, as a prototype to re-run:
the `checkpoint` section as a pydantic v2 model next to ours, on the same bad inputs.

    python bench/pydantic_prototype.py      # needs `pip install pydantic` (not a dependency)

Prints, per input, our one-line message and the one pydantic's errors give once mapped to our
format, and the import cost of each (the CLI must answer fast on a login node).
"""
from __future__ import annotations

import subprocess
import sys

BAD = [{"every_steps": -1}, {"keep_last": 0}, {"keep_last": "3"}, {"async_save": "yes"},
       {"barrier_timeout_s": 1e12}, {"keep_lats": 2}]


def ours(section: dict) -> str:
    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.errors import UserError

    try:
        config_from_dict({"checkpoint": section})
    except UserError as exc:
        return str(exc)
    return "accepted"


def theirs(section: dict) -> str:
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    class Checkpoint(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        every_steps: int = Field(0, ge=0, description="save every N steps; 0: only at the end")
        keep_last: int = Field(3, ge=1, description="committed checkpoints kept")
        async_save: bool = Field(False, description="write in a background thread")
        barrier_timeout_s: float = Field(0.0, ge=0, le=604800, description="0: parallel.timeout_s")

    try:
        Checkpoint(**section)
    except ValidationError as exc:
        err = exc.errors()[0]  # our format: one line, the key, the fix
        return f"checkpoint.{'.'.join(map(str, err['loc']))}: {err['msg']}"
    return "accepted"


def import_ms(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print((time.perf_counter() - t) * 1e3)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


if __name__ == "__main__":
    for section in BAD:
        print(f"{section}\n  ours:     {ours(section)}\n  pydantic: {theirs(section)}")
    print(f"import enn_cluster.config.loading:    {import_ms('enn_cluster.config.loading'):.0f} ms")
    print(f"import pydantic (BaseModel):          {import_ms('pydantic.main'):.0f} ms")
