"""Hypothesis strategies of hostile input shared by the fuzz tests, the one-line error
contract, and shellcheck of rendered text."""
from __future__ import annotations

import dataclasses
import subprocess
import typing
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import render_support
from enn_cluster.config.run_config import RunConfig

FAST = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])
SHELL = settings(FAST, max_examples=20)  # each example runs bash and shellcheck
PROCS = settings(FAST, max_examples=15)  # each example starts an enn-submit process

# Pieces of hostile text; CANARY_* files appear in the working directory if any executes.
PIECES = ("$(touch CANARY_a)", "`touch CANARY_b`", "; touch CANARY_c", "| touch CANARY_d",
          "&& touch CANARY_e", "$HOME", "${PATH}", "'", '"', "\\", "\n", "\r", "\t", " ", ",",
          ":", "=", "#", "%", "%j", "*", "?", "~", "!", "&", "<", ">", "{", "}", "[", "]",
          "..", "/", "-", "--", "ü", "λ", "✓", "名", "\u200b", "\x7f", "\x1b[31m", "-rf")
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=6)
HOSTILE = st.lists(st.sampled_from(PIECES) | _text, min_size=1, max_size=5).map("".join)
ARGV_SAFE = HOSTILE.filter(lambda t: "\x00" not in t)  # argv cannot carry NUL
NUMBERS = st.sampled_from([0, -1, 1, 2, -(2**63), 2**64, 10**30, 10**400]) | st.integers()
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1e-300, 1e300, float("inf"), float("nan")])
ANY = st.recursive(st.none() | st.booleans() | NUMBERS | FLOATS | HOSTILE,
                   lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(HOSTILE, inner, max_size=3), max_leaves=6)


def _flag(name, values):
    return st.tuples(st.just(name), values).map(list)


# launch flags with hostile values, as a command line (the CLI fuzz) or the API's `cluster=`
# (tests/client/test_api_words.py) gives them
RENDER_FLAGS = st.lists(st.one_of(
    _flag("--job-name", ARGV_SAFE | st.sampled_from(["enn-x", "ü.v1"])),
    _flag("--mount", ARGV_SAFE | st.sampled_from(["/data:/data:ro", "/a:/b:rw"])),
    _flag("--container", st.sampled_from(["none", "/img/enn.sqsh", "nvcr.io#nvidia/pytorch:24.05"])
          | ARGV_SAFE),
    _flag("--set", st.tuples(st.sampled_from(["run_name=", "runs_root=/tmp/", "training.lr=",
                                              "model.kwargs.k="]), ARGV_SAFE).map("".join)),
    _flag("--partition", ARGV_SAFE), _flag("--time", ARGV_SAFE | st.sampled_from(["30", "2-00"])),
    _flag("--nodes", ARGV_SAFE | st.sampled_from(["2", "1-3", "0", "-1"])),
    _flag("--python", ARGV_SAFE), _flag("--signal-grace", ARGV_SAFE | st.sampled_from(["0", "30"])),
    st.just(["--admin"]),
), max_size=4).map(lambda pairs: [a for pair in pairs for a in pair])


def one_line_error(message: str) -> None:
    assert message and len(message.strip().splitlines()) == 1, message
    assert "Traceback" not in message and "\x1b" not in message, message


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy = HOSTILE) -> st.SearchStrategy:
    """Valid seven times in eight: enough examples get past validation to be rendered."""
    return st.sampled_from((False,) * 7 + (True,)).flatmap(
        lambda bad: hostile if bad else valid)


def _leaf(tp) -> st.SearchStrategy:
    """Values for a field of type `tp`: mostly well-typed (huge, negative, non-finite,
    hostile), sometimes anything at all."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    typed = {int: NUMBERS, float: FLOATS | NUMBERS, bool: st.booleans(), str: HOSTILE,
             list: st.lists(NUMBERS | HOSTILE, max_size=3),
             dict: st.dictionaries(HOSTILE, ANY, max_size=3)}.get(base, ANY)
    return mostly(typed, ANY)


def _section(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        fields[f.name] = _section(tp) if dataclasses.is_dataclass(tp) else _leaf(tp)
    known = st.fixed_dictionaries({}, optional=fields)
    unknown = st.dictionaries(HOSTILE | NUMBERS, ANY, max_size=1)
    return mostly(known, st.tuples(known, unknown).map(lambda p: {**p[0], **p[1]}) | ANY)


CONFIGS = _section(RunConfig)


def shellcheck(text: str, tmp: Path, exclude: tuple = ()) -> None:
    """`text` as a script file passes bash -n and shellcheck (less `exclude`)."""
    path = tmp / "job.sbatch"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, text
    render_support.shellcheck(path, exclude)
