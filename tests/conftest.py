"""Shared pytest setup. Fixtures for the real local Slurm cluster live in slurm_fixture.py."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two or three xdist workers share CI's two cores (Makefile). An OpenMP thread spins
# while it waits for its next parallel region (libgomp's default), on CPU the other workers'
# processes need; PASSIVE puts it to sleep. Set before anything here imports torch, so every
# process the tests start inherits it: `make test-fast` used 10 % less CPU time (277 -> 249
# CPU-seconds, 1,658 tests, the same results). Not the package's default: a real node's
# ranks have their cores to themselves.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest_plugins = ["slurm_fixture", "pyxis_fixture"]


import pytest  # noqa: E402


CLUSTER_MARKS = ("slurm", "podman")


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item):
    """Under pytest-xdist's `loadgroup` (`make test` runs two workers, test-fast three)
    every test needing the local Slurm cluster or podman goes to one worker, which alone
    boots the session's
    clusters and builds its images, and every other module stays whole on one worker (its
    module fixtures are made once). Marked here, at collection: xdist's worker reads the
    marks in its own collection_modifyitems, which ran before ours did. A worker sees dist
    "no" and loadgroup True (xdist/remote.py setup_config)."""
    if getattr(item.config.option, "loadgroup", False):
        cluster = any(item.get_closest_marker(m) for m in CLUSTER_MARKS)
        item.add_marker(pytest.mark.xdist_group("cluster" if cluster else item.module.__name__))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test-fast` (ENN_TEST_TIER=fast): the tests a full run timed as slow are left out
    (tests/tiers.py); every other run keeps them all. Ids are compared without xdist's
    "@group" suffix."""
    if os.environ.get("ENN_TEST_TIER") == "fast":
        from tiers import listed

        slow = listed()
        keep = [item for item in items if item.nodeid.partition("@")[0] not in slow]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """One uninterrupted 2x2 HSDP run of helpers.small_config, shared read-only by the
    tests that compare a faulted or moved run with it (copy it before changing it)."""
    from helpers import cli, small_config, write_config

    tmp = tmp_path_factory.mktemp("baseline")
    cfg = write_config(tmp / "run.yaml", **small_config(tmp, "base"))
    res = cli("train", "--config", cfg)
    assert res.returncode == 0, res.stderr
    return tmp / "runs" / "base"



@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """A worker whose loadgroup grouping did not take stops here: the tests would still run,
    spread as if unmarked, and module fixtures and Slurm clusters would be made twice."""
    if getattr(session.config.option, "loadgroup", False) and session.items and \
            "@" not in session.items[0].nodeid:
        raise pytest.UsageError("--dist loadgroup: pytest-xdist did not group the tests "
                                "(pytest-dev/pytest-xdist#1386); install with "
                                "-c constraints-dev.txt (pytest<9.2)")
