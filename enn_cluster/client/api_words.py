"""The Python API's errors in the API's own words. The API runs the CLI's functions; a
UserError about an input (config/inputs.py) carries the input, not the CLI's flag for it, and
leaves an API function rendered here, at the boundary, with the names that function takes:
`cluster["nodes"]` for --nodes, `X` for --input, the run argument's own name for RUN_DIR."""
from __future__ import annotations

import functools
from typing import Callable

from enn_cluster.errors import UserError


def speaks_api(**names: str) -> Callable:
    """Decorate an API function: its UserErrors reach the caller in the API's words, with
    `names` (input name -> this function's argument) where its arguments differ from the
    inputs table's (`run_dir="Run.open(path)"`)."""
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def call(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except UserError as exc:
                exc.args = (exc.rendered("api", names), *exc.args[1:])
                raise
        return call
    return wrap
