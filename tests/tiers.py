"""The fast tier (`make test-fast`): every test but the Slurm, podman and `slow`-marked ones
and those a measured full run timed at SLOW_S seconds or more (listed in slow_tests.txt).

    make test PYTEST_ARGS=--junitxml=/tmp/full.xml
    python tests/tiers.py /tmp/full.xml     # rewrites tests/slow_tests.txt

`make test` and CI always run everything; the list only shapes the edit-test loop.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOW_S = 2.5
LIST = Path(__file__).with_name("slow_tests.txt")


def node_id(classname: str, name: str) -> str:
    """A junit record's pytest node id: `tests.worker.test_x.TestC` + `t[p]` ->
    `tests/worker/test_x.py::TestC::t[p]` (the module is the first part named test_*)."""
    parts = classname.split(".")
    name = name.partition("@")[0]  # xdist's loadgroup suffix (conftest compares without it)
    module = next(i for i, part in enumerate(parts) if part.startswith("test_")) + 1
    return "/".join(parts[:module]) + ".py::" + "::".join([*parts[module:], name])


def slow_tests(junit_xml: str, slow_s: float = SLOW_S) -> list[str]:
    root = ET.parse(junit_xml).getroot()
    return sorted(node_id(c.get("classname"), c.get("name")) for c in root.iter("testcase")
                  if float(c.get("time") or 0) >= slow_s)


def listed() -> set[str]:
    if not LIST.is_file():
        return set()
    return {line.strip() for line in LIST.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


if __name__ == "__main__":
    ids = slow_tests(sys.argv[1])
    LIST.write_text(f"# tests a full run timed at {SLOW_S:g} s or more: left out of "
                    "`make test-fast` (tests/tiers.py)\n" + "".join(f"{i}\n" for i in ids))
    print(f"{len(ids)} slow tests listed in {LIST}")
