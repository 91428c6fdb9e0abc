"""A run YAML file read as data: a regular file of UTF-8 text, valid YAML, no key given
twice, bounded depth and size; every failure is one line naming the file."""
from __future__ import annotations

import yaml

from enn_cluster.config.checks import _check_tree, check_regular_file
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError

CONFIG = INPUTS["config"]


def _no_duplicate_keys(node, path: str, where: tuple = (), walked=None) -> None:
    """YAML keeps the last of two equal keys without a word; a run config that says
    `lr` twice is refused, naming the key, so that nobody trains with the value they did not
    mean. Each node is walked once (an alias is not expanded again)."""
    walked = set() if walked is None else walked
    if id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
            if name in seen:
                dotted = ".".join((*where, name))
                raise UserError(f"{dotted}: given twice in {path} (line {key.start_mark.line + 1}); "
                                "keep one")
            seen.add(name)
            _no_duplicate_keys(value, path, (*where, name), walked)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicate_keys(item, path, where, walked)


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class PlainLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 numbers: `1:30` stays the text it
    looks like (a wrong type, named by the field's check) instead of becoming 90."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and ":" in value and tag in _NUMBER_TAGS:
            return "tag:yaml.org,2002:str"
        return tag


def load_text(text: str, path: str = "<text>"):
    """YAML text as data: no base-60 numbers, and (for a file's text) no key given twice."""
    _no_duplicate_keys(yaml.compose(text, Loader=PlainLoader), path)
    return yaml.load(text, Loader=PlainLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str) -> dict:
    if not str(path).strip():
        raise UserError("an empty path", field=CONFIG,
                        fix="pass the path of a run YAML (or leave {field} out for the defaults)")
    check_regular_file(CONFIG, path, "pass the path of a run YAML")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        data = load_text(text, path)
    except FileNotFoundError:
        raise UserError.on(CONFIG, f"{path} does not exist; pass the path of a run YAML")
    except IsADirectoryError:
        raise UserError.on(CONFIG, f"{path} is a directory; pass the path of a run YAML")
    except OSError as exc:
        raise UserError.on(CONFIG, f"cannot read {path} ({exc.strerror or exc}); "
                                   "fix its permissions or pass another file")
    except UnicodeDecodeError:
        raise UserError.on(CONFIG, f"{path} is not UTF-8 text; pass a run YAML")
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: a bad date, a huge number
        first = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise UserError.on(CONFIG, f"{path} is not valid YAML ({first})")
    except RecursionError:
        raise UserError.on(CONFIG, f"{path} is nested too deeply to be a run config") from None
    _check_tree(data, CONFIG, f"{path}: ")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError.on(CONFIG, f"{path} must hold a mapping of sections at the top level")
    return data
