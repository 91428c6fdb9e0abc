"""Host lists expanded as Slurm expands them: the answers of a real `scontrol show
hostnames` (tests/data/slurm/hostnames.txt, captured on slurm/dev/cluster.sh) are ours."""
from __future__ import annotations

import pytest

from enn_cluster.errors import UserError
from enn_cluster.storage.hostlist import expand_hostlist
from enn_cluster.worker.environment import expand_hostlist as worker_expand
from helpers import TESTS

CAPTURED = TESTS / "data" / "slurm" / "hostnames.txt"


def captured_cases() -> list[tuple[str, list[str]]]:
    cases, case = [], None
    for line in CAPTURED.read_text().splitlines():
        if line.startswith("> "):
            case = (line[2:], [])
            cases.append(case)
        elif case is not None and line:
            case[1].append(line)
    return cases


@pytest.mark.parametrize("text,hosts", captured_cases(), ids=[c for c, _ in captured_cases()])
def test_as_real_scontrol_expands_it(text, hosts):
    if hosts == ["! refused"]:
        if text == "gpu-a[1-2]-ib":  # Slurm 22.05 refuses a suffix after brackets; newer
            assert expand_hostlist(text) == ["gpu-a1-ib", "gpu-a2-ib"]  # ones accept it
            return
        with pytest.raises(ValueError):
            expand_hostlist(text)
    else:
        assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,7],gpu-a[1-2]-ib", ["node01", "node02", "node03", "node7", "gpu-a1-ib",
                                     "gpu-a2-ib"]),
    ("r[1-2]-n[1,3]-ib", ["r1-n1-ib", "r1-n3-ib", "r2-n1-ib", "r2-n3-ib"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[0008-0010]", ["n0008", "n0009", "n0010"]),
    (" a , b ", ["a", "b"]),
    ("n[1,1]", ["n1", "n1"]),
])
def test_suffixes_padding_and_nested_commas(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,why", [
    ("n[1-2", "never closed"), ("n1]", "without"), ("n[[1]]", "inside brackets"),
    ("n[]", "not N or N-M"), ("n[1-]", "not N or N-M"), ("n[2-1]", "backwards"),
    ("a,,b", "empty name"), ("", "empty name"), ("n[1-9999999]", "too long"),
    ("a b", "space"),
])
def test_what_is_not_a_host_list_is_named(text, why):
    with pytest.raises(ValueError, match=why):
        expand_hostlist(text)


def test_the_worker_says_which_variable_and_what_to_do():
    assert worker_expand("n[1-2]") == ["n1", "n2"]
    with pytest.raises(UserError, match=r"SLURM_JOB_NODELIST='n\[1-2'.*never closed.*MASTER_ADDR"):
        worker_expand("n[1-2")
