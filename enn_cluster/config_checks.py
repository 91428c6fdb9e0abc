"""Checks on single config values, each raising a UserError that names the key and the fix.

Kept apart from the dataclasses in config.py so the rules (bounds, secrets, path text,
YAML shape) read in one place.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Any, Optional

from .errors import UserError

MAX_SEED = 2**32 - 1  # numpy and torch both take it; negative seeds fail in numpy
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000


_METRICS_PATH = re.compile(r"metrics\.jsonl|metrics(/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}){1,4}\.jsonl")


def check_metrics_path(key: str, value: str) -> None:
    """The metrics file is `metrics.jsonl` or lies under `metrics/`: any other name in the
    run directory may be a control file (run.lock, config.yaml, jobs.jsonl) it would corrupt."""
    if not _METRICS_PATH.fullmatch(str(value)):
        raise UserError(f"{key}: {str(value)[:80]!r} must be metrics.jsonl or a .jsonl file "
                        "under metrics/ (e.g. metrics/train.jsonl); the run directory's other "
                        "names are its control files")


def _positive(key: str, value: Any) -> None:
    if not value > 0:
        raise UserError(f"{key}: {value!r} must be a positive integer")


def _non_negative(key: str, value: Any) -> None:
    if value < 0:
        raise UserError(f"{key}: {value!r} must be >= 0")


def _seed(key: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"{key}: {value!r} must be between 0 and {MAX_SEED}")


_SECRET_NAME = re.compile(r"token|secret|passw|api_?key|credential|auth(?!or)", re.IGNORECASE)


def _no_secret_keys(where: str, tree: Any) -> None:
    """config.yaml is frozen into a group-readable run directory: no secrets in it."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for key, value in items:
        name = f"{where}.{key}"
        if isinstance(key, str) and _SECRET_NAME.search(key) and value not in (None, ""):
            raise UserError(f"{name}: looks like a secret, and the config is frozen into the "
                            "run directory; read it from an environment variable instead")
        _no_secret_keys(name, value)


def no_credentials_in_url(key: str, value: Optional[str],
                          where: str = "the environment or the fsspec config") -> None:
    """A URL with user:password@ would be frozen into config.yaml; refuse it."""
    if not value or "://" not in value:
        return
    from urllib.parse import urlsplit

    try:
        has = urlsplit(value).password is not None
    except ValueError:
        raise UserError(f"{key}: {value!r} is not a valid URL")
    if has:
        raise UserError(f"{key}: the URL holds a password, and the config is frozen into the "
                        f"run directory; give credentials through {where} instead")


def _path_text(key: str, value: str) -> None:
    """Text that becomes a path: valid UTF-8, no control characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{key}: {value!r} is not valid UTF-8 text; use plain characters")
    bad = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise UserError(f"{key}: {value!r} contains the control character {bad!r}; remove it")


def _check_tree(data: Any, where: str) -> None:
    """Refuse YAML that only aliases make finite (self-referencing anchors, 'billion laughs'):
    the walks below would recurse forever or expand it exponentially."""
    stack, count = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_YAML_DEPTH or count > MAX_YAML_VALUES:
            raise UserError(f"{where}: nested deeper than {MAX_YAML_DEPTH} levels or more than "
                            f"{MAX_YAML_VALUES} values (an alias that refers to itself?); "
                            "write the values out plainly")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key}: {value!r} is not one of {', '.join(choices)}")
