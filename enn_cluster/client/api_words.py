"""The Python API's errors in the API's own words. The API runs the CLI's functions, whose
messages name the CLI's flags (`--container`, `--input`) and its RUN_DIR argument; a
caller of `enn_cluster.predict(run, X)` has neither, so every UserError that leaves an API
function is reworded here, at the boundary, with the names that function takes."""
from __future__ import annotations

import functools
import re
from typing import Callable, Mapping

from enn_cluster.config.launch_options import OPTIONS
from enn_cluster.errors import UserError

# CLI flag -> the key of the API's `cluster=` dict (config/launch_options.py), and the
# JobSpec's name for the image
CLUSTER_WORDS = {o.flag: f'cluster["{o.api}"]' for o in OPTIONS if o.flag and o.api}
CLUSTER_WORDS["--container-image"] = 'cluster["container"]'

TRAIN_WORDS = {**CLUSTER_WORDS, "RUN_DIR": "run_dir", "--set": "the keyword sections",
               "--config": "config"}
PREDICT_WORDS = {**CLUSTER_WORDS, "RUN_DIR": "run_or_dir", "--input": "X", "--step": "step",
                 "--name": "name", "--out": "out", "--chunk-rows": "chunk_rows",
                 "--batch-size": "batch_size", "--raw": "raw"}
EXPORT_WORDS = {"RUN_DIR": "run_or_dir", "--out": "out", "--step": "step", "--format": "format",
                "--dtype": "dtype", "--max-shard-mb": "max_shard_mb"}
RUN_WORDS = {"RUN_DIR": "Run.open(path)", "--step": "step"}

# a CLI name, optionally with the placeholder or literal value the message shows after it
_NAME = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|RUN_DIR)(?![\w-])( [A-Z][A-Z_]*\b| none\b)?")


def reworded(message: str, words: Mapping[str, str]) -> str:
    """`message` with each CLI name in `words` replaced by the API's; "--container IMAGE"
    becomes 'cluster["container"]=IMAGE', "--container none" 'cluster["container"]="none"'."""
    def one(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        if name not in words:
            return match.group(0)
        if not value:
            return words[name]
        value = value.strip()
        return f'{words[name]}={value}' if value.isupper() else f'{words[name]}="{value}"'

    return _NAME.sub(one, message)


def speaks_api(words: Mapping[str, str]) -> Callable:
    """Decorate an API function: its UserErrors reach the caller reworded by `words`."""
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def call(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except UserError as exc:
                exc.args = (reworded(str(exc), words), *exc.args[1:])
                raise
        return call
    return wrap
