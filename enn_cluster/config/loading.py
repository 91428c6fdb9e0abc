"""Run config loading: YAML and `--set` overrides into the typed `RunConfig`, and back.

Kept apart from the schema in run_config.py so the dataclasses read as the list of
settings; this module turns untrusted data (a YAML file, `KEY=VALUE` flags) into them,
checking every leaf against its annotated type, and dumps a resolved config as YAML.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Optional

import yaml

from enn_cluster.config.checks import _check_tree, no_secret_values
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.yaml_file import PlainLoader, read_yaml
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError, did_you_mean


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check one leaf against its annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X], or one of several (a word or a list)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) > 1:
            if any(isinstance(value, typing.get_origin(a) or a) for a in args):
                return value
            raise UserError(f"{key}: expected {' or '.join(a.__name__ for a in args)}, got "
                            f"{shown(key, value)}")
        tp = args[0]
        origin = typing.get_origin(tp)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise UserError(f"{key}: {value!r} is not a finite number; give a plain value")
        return value
    if tp is str and key.endswith((".bf16", ".async_save")) and isinstance(value, bool):
        return str(value).lower()
    if tp is str and key == "profiling.steps" and type(value) is int:  # one step: `=20`
        return str(value)
    expected = origin or tp
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        name = getattr(expected, "__name__", str(expected))
        raise UserError(f"{key}: expected {name}, got {shown(key, value)}")
    return value


def shown(key: str, value: Any) -> str:
    """A wrong value as an error line may show it: a scalar's repr (cut to 60 characters),
    a container by its type and size only (a secret may sit at any depth under it), and
    nothing of a value whose key or text looks secret."""
    from enn_cluster.config.checks import looks_secret_key
    from enn_cluster.errors import looks_secret

    kind = type(value).__name__
    if isinstance(value, (dict, list, tuple, set)):
        return f"a {kind} of {len(value)} item(s)"
    if looks_secret_key(key) or looks_secret(value):
        return f"a {kind} (not shown: it looks like a secret)"
    return f"{kind} {repr(value)[:60]}"


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise UserError(f"{where}: unknown key{did_you_mean(unknown[0], names)}; valid keys "
                        f"here are {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:  # YAML 1.1 reads 1e-4 as text: a number, except where text is meant
            text = tp in (str, Optional[str])
            kwargs[name] = _coerce(key, value if text else _fix_yaml_floats(value), tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.lr=1e-4` -> (["training", "lr"], 0.0001); the value is parsed as YAML."""
    if "=" not in text:
        raise _not_key_value(text)
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise _not_key_value(text)
    try:
        value = yaml.load(raw, Loader=PlainLoader) if raw.strip() else ""  # noqa: S506
    except (yaml.YAMLError, ValueError):  # ValueError: a bad date or a 5000-digit number
        value = raw
    except RecursionError:
        raise UserError.on(Said(INPUTS["set"], key), "the value is nested too deeply",
                           fix="give a plain value") from None
    _check_tree(value, Said(INPUTS["set"], key))
    if isinstance(value, float) or isinstance(value, str):
        # YAML 1.1 reads "1e-4" as a string; accept it as the float it means.
        try:
            value = float(value) if isinstance(value, str) and _looks_float(value) else value
        except ValueError:
            pass
    return key.split("."), value


def _not_key_value(text: str) -> UserError:
    return UserError("{set} {text!r}: expected KEY=VALUE, e.g. {example}", set=INPUTS["set"],
                     text=text, example=Said(INPUTS["set"], "training.lr=1e-4"))


def _looks_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return any(c in text.lower() for c in ".e") and text.strip().lower() not in ("inf", "nan")


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError.on(Said(INPUTS["set"], text), f"{part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _map_leaves(data: Any, leaf) -> Any:
    """A copy of nested dicts and lists with `leaf` applied to every other value."""
    if isinstance(data, dict):
        return {k: _map_leaves(v, leaf) for k, v in data.items()}
    if isinstance(data, list):
        return [_map_leaves(v, leaf) for v in data]
    return leaf(data)


def _deepcopy(data: Any) -> Any:
    return _map_leaves(data, lambda v: v)


def _fix_yaml_floats(data: Any) -> Any:
    return _map_leaves(data, lambda v: float(v) if isinstance(v, str) and _looks_float(v) else v)


# keys that left the schema, which the config.yaml of a run made before may still hold
# (every run freezes the whole config): the test-only faults are ENN_TEST_FAULTS now
RETIRED_KEYS = {"training": ("fail_at_step", "fail_rank", "oom_at_step")}


def without_retired_keys(data: Any) -> Any:
    """A run's frozen config without the keys a newer enn_cluster no longer has."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for section, names in RETIRED_KEYS.items():
        if isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in data[section].items() if k not in names}
    return data


def config_from_dict(data: Any) -> RunConfig:
    _check_tree(data, "config")
    cfg = _build(RunConfig, data, "").validate()
    for key, value in (data or {}).items():  # after the fields' own checks, with their wording
        no_secret_values(str(key), value)
    return cfg


def load_config(path: Optional[str], overrides: list[str] = (),
                verbatim: Optional[dict] = None) -> RunConfig:
    """`verbatim` (top-level keys from flags that name things) are taken as given, never YAML."""
    return layered_config(read_yaml(path) if path else {}, overrides, verbatim)


def layered_config(data: dict, overrides: list[str] = (),
                   verbatim: Optional[dict] = None) -> RunConfig:
    """`data` (a config file's), then --set overrides (YAML values), then `verbatim`."""
    return config_from_dict({**apply_overrides(data, list(overrides)), **(verbatim or {})})


def config_to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
