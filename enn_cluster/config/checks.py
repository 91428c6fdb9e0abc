"""Checks on single config values, each raising a UserError that names the key and the fix.

Kept apart from the dataclasses in config.py so the rules (bounds, secrets, path text,
YAML shape) read in one place.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Any, Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError, did_you_mean

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


MAX_COUNT = 10**9  # epochs and steps: far beyond any run, far below int64 step counters
MAX_BATCH_ROWS = 2**24  # rows per device per micro-batch, and accumulation steps
MAX_GLOBAL_BATCH = 2**31  # rows per optimizer step
MAX_NODES = 2**16  # beyond the largest Slurm allocation anyone has
MAX_PROCS_PER_NODE = 1024  # processes (GPUs) per node
MAX_WIDTH = 2**20  # units of one layer: a square layer this wide is 2**40 weights already
MAX_LAYERS = 4096


def _bounded(key: str, value: Any, most: int) -> None:
    if not 0 < value <= most:
        raise UserError(f"{key}: {value!r} must be a positive integer of at most {most}")


def _positive(key: str, value: Any) -> None:
    if not value > 0:
        raise UserError(f"{key}: {value!r} must be a positive integer")


def _non_negative(key: str, value: Any) -> None:
    if value < 0:
        raise UserError(f"{key}: {value!r} must be >= 0")


def _seed(key: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise UserError(f"{key}: {value!r} must be between 0 and {MAX_SEED}")


# key names that hold secrets: api-key and api_key alike, Authorization but not author
_SECRET_NAME = re.compile(r"token|secret|pass(?:w|phrase|$)|pwd|api[-_ ]?key|private[-_ ]?key"
                          r"|access[-_ ]?key|credential|cookie|bearer|authori[sz]ation"
                          r"|auth(?!or)", re.IGNORECASE)


def looks_secret_key(name: str) -> bool:
    """Does a config key's name (its last part) say it holds a secret?"""
    return bool(_SECRET_NAME.search(str(name).rsplit(".", 1)[-1]))


def _no_secret_keys(where: str, tree: Any) -> None:
    """config.yaml is frozen into a group-readable run directory: no secrets in it, by a
    key's name or by what its value looks like. The value is never shown."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for key, value in items:
        name = f"{where}.{key}"
        if isinstance(key, str) and _SECRET_NAME.search(key) and value not in (None, ""):
            raise UserError(f"{name}: looks like a secret, and the config is frozen into the "
                            "run directory; read it from an environment variable instead")
        no_secret_values(name, value)
        _no_secret_keys(name, value)


def no_secret_values(where: str, tree: Any) -> None:
    """Refuse a string anywhere under `where` that holds a credential (a password in a URL
    or DSN, a token in a query string, a Bearer header): named by its key, not shown."""
    from enn_cluster.errors import looks_secret

    stack = [(where, tree)]
    while stack:
        name, node = stack.pop()
        if looks_secret(node) or (isinstance(node, str) and _url_secret_or_none(node)):
            raise UserError(f"{name}: holds what looks like a credential (not shown), and the "
                            "config is frozen into the run directory; give it through the "
                            "environment instead")
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, (list, tuple)) else ()
        stack.extend((f"{name}.{k}", v) for k, v in items)


_SECRET_QUERY = re.compile(r"token|secret|pass(?:w|phrase|$)|pwd|sig(nature)?$|credential"
                           r"|api[-_ ]?key|private[-_ ]?key|access[-_ ]?key|^key$|^code$"
                           r"|authori[sz]ation|auth(?!or)", re.IGNORECASE)


def _url_secret_or_none(value: str) -> Optional[str]:
    try:
        return _url_secret(value)
    except ValueError:
        return None  # not a URL at all: the field's own check says so


def _url_secret(value: str) -> Optional[str]:
    """What credential a URL holds ('' when it parses but holds none); None when no URL."""
    if "://" not in value:
        return None
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(value)  # ValueError: the caller says 'not a valid URL', nothing more
    if parts.username is not None or parts.password is not None:
        return "user or token before '@'"
    for where, text in (("query string", parts.query), ("fragment", parts.fragment)):
        if any(_SECRET_QUERY.search(k) for k, _ in parse_qsl(text, keep_blank_values=True)):
            return f"credential in its {where}"
    return ""


def no_credentials_in_url(key: str, value: Optional[str],
                          where: str = "the environment or the fsspec config") -> None:
    """A URL with credentials (user:password@, TOKEN@, ?token=, ?access_token=, a signature)
    would be frozen into config.yaml and echoed in messages; refuse it without echoing it."""
    if not value or "://" not in value:
        return
    try:
        what = _url_secret(value)
    except ValueError:
        raise UserError.on(key, "is not a valid URL (not shown: it may hold a secret); "
                                "check it") from None
    if what:
        raise UserError.on(key, f"the URL holds a {what}, and the config is frozen into the "
                                f"run directory; give credentials through {where} instead")


def check_regular_file(key: str, path: str, fix: str) -> None:
    """Missing, a directory, a FIFO or a device: refused by name (reading a FIFO blocks
    forever, a device never ends)."""
    import os
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError.on(key, f"{path} does not exist; {fix}") from None
    except OSError as exc:
        raise UserError.on(key, f"cannot open {path} ({exc.strerror}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError.on(key, f"{path} is {kind}; {fix}")


def _path_text(key: str, value: str) -> None:
    """Text that becomes a path: valid UTF-8, no control characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{key}: {value!r} is not valid UTF-8 text; use plain characters")
    # Cc: controls; Cf: invisible format marks (bidi overrides); Zl/Zp: U+2028/U+2029, line
    # and paragraph separators that end a line in editors, logs and JSON-reading tools
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        raise UserError(f"{key}: {ascii(value)} contains the control character {ascii(bad)}; "
                        "remove it")


def check_home(key: str, value: str) -> None:
    """A path starting with ~ or ~user must expand: Python leaves '~nosuchuser/x' as it is
    (a relative directory named so) and pathlib raises RuntimeError."""
    import os

    if value.startswith("~") and os.path.expanduser(value) == value:
        user = value[1:].split("/", 1)[0]
        who = f"no user {user!r} on this machine" if user else "no home directory is known"
        raise UserError.on(key, f"{value!r} cannot be expanded ({who}); give an absolute path")


def _check_tree(data: Any, where, shown: str = "") -> None:
    """Refuse YAML that only aliases make finite (self-referencing anchors, 'billion laughs'):
    the walks below would recurse forever or expand it exponentially. `where`: the key or
    input (config/inputs.py) that holds it; `shown`: text after its name (a file's path)."""
    stack, count = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_YAML_DEPTH or count > MAX_YAML_VALUES:
            raise UserError.on(where, f"{shown}nested deeper than {MAX_YAML_DEPTH} levels or "
                               f"more than {MAX_YAML_VALUES} values (an alias that refers to "
                               "itself?); write the values out plainly")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key}: {value!r} is not one of {', '.join(choices)}"
                        f"{did_you_mean(value, choices)}")


def node_range(value) -> tuple[int, int]:
    """--nodes N or MIN-MAX (Slurm grants a count in the range; DCP reshards): the one
    parser, for the launch shape and the job spec alike."""
    if isinstance(value, str) and re.fullmatch(r"[0-9]+-[0-9]+", value.strip()):
        lo, hi = (int(x) for x in value.strip().split("-"))
    elif isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        lo = hi = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        lo = hi = value
    else:
        raise UserError("{value!r} is not a node count", field=INPUTS["nodes"], value=value,
                        fix="give N or a range MIN-MAX")
    if not 1 <= lo <= hi:
        raise UserError("{value!r} is empty or below 1", field=INPUTS["nodes"], value=value,
                        fix="give 1 <= MIN <= MAX")
    if hi > MAX_NODES:
        raise UserError("{value!r} is more than {most} nodes", field=INPUTS["nodes"],
                        value=value, most=MAX_NODES, fix="give a real count")
    return lo, hi
