"""`make test-fast` leaves out what tests/slow_tests.txt lists; the list is made from a real
run's junit record and names tests that exist."""
from __future__ import annotations

from tiers import LIST, listed, node_id, slow_tests


def test_junit_records_become_pytest_node_ids(tmp_path):
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_a" name="test_x[1-2]" time="7.5"/>'
                   '<testcase classname="tests.worker.test_b.TestC" name="test_y" time="9"/>'
                   '<testcase classname="tests.test_a" name="test_quick" time="0.2"/>'
                   '</testsuite></testsuites>')
    assert slow_tests(str(xml)) == ["tests/test_a.py::test_x[1-2]",
                                    "tests/worker/test_b.py::TestC::test_y"]
    assert node_id("tests.test_a", "t") == "tests/test_a.py::t"
    assert node_id("tests.storage.test_a", "t@g") == "tests/storage/test_a.py::t"


def test_every_listed_slow_test_names_a_test_file_that_exists():
    ids = listed()
    assert ids, f"{LIST} lists no test"
    root = LIST.parent.parent
    missing = sorted({i.split("::")[0] for i in ids if not (root / i.split("::")[0]).is_file()})
    assert not missing, missing
