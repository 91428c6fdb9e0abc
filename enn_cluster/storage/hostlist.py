"""Slurm's compact host lists, expanded: 'node[01-03,7],gpu-a[1-2]-ib' -> node01 node02
node03 node07 gpu-a1-ib gpu-a2-ib. What SLURM_JOB_NODELIST and scontrol's NodeList hold;
the worker reads one inside a container, where there is no `scontrol show hostnames`."""
from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_HOSTS = 1 << 16  # a typo such as n[1-9999999] is refused, not expanded


def expand_hostlist(text: str) -> list[str]:
    """Every host of `text`, in order (duplicates kept, as Slurm keeps them). A range takes
    the width of its first number ('[08-10]' -> 08 09 10); several bracket groups in one
    name multiply ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2). ValueError names what is wrong."""
    hosts: list[str] = []
    for item in _top_level_items(text):
        hosts += _expand_item(item)
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
    return hosts


def _top_level_items(text: str) -> list[str]:
    """`text` split at the commas outside brackets; a bracket left open or never opened
    is refused."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {text!r}: '[' inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: '[' never closed")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise ValueError(f"host list {text!r}: an empty name")
    return [item.strip() for item in items]


def _expand_item(item: str) -> list[str]:
    """One name with zero or more bracket groups -> its hosts."""
    parts = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
    choices = [[p] if i % 2 == 0 else _expand_group(p, item) for i, p in enumerate(parts)]
    if any(re.search(r"\s", p) for p in parts[::2]):
        raise ValueError(f"host list item {item!r}: a space in a host name")
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_group(group: str, item: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']."""
    out: list[str] = []
    for part in group.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"host list item {item!r}: {part!r} is not N or N-M")
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"host list item {item!r}: range {part!r} runs backwards")
        if hi - lo >= MAX_HOSTS:
            raise ValueError(f"host list item {item!r}: range {part!r} is too long")
        out += [str(n).zfill(len(lo_text)) for n in range(lo, hi + 1)]
    return out
