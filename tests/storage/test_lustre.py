"""checkpoint.lustre_stripe_count (issue 39 section 2): a new run's `checkpoints/` is striped
when the run directory is on Lustre, so that a save's shard files spread over OSTs.

There is no Lustre here, so `lfs` is a script on PATH that answers as Lustre's tool does
(getstripe succeeds on a Lustre directory, fails elsewhere) and records what it was asked;
what is tested is ours: whether `lfs` is asked, with which arguments, on which directory,
what the user is told, and that a failing `lfs` never stops or damages the run.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from enn_cluster.storage.lustre import stripe_command
from helpers import cli, small_config, write_config

FAKE_LFS = """#!/bin/bash
# answers as lfs does on a Lustre mount (FAKE_LUSTRE=1) or elsewhere; records its arguments
printf '%s\\n' "$*" >> "$FAKE_LFS_LOG"
case "$1" in
  getstripe) [ "${FAKE_LUSTRE:-0}" = 1 ] || { echo "lfs getstripe: $4 is not on a Lustre filesystem" >&2; exit 25; } ;;
  setstripe) [ "${FAKE_SET_FAILS:-0}" = 0 ] || { echo "lfs setstripe: Operation not permitted" >&2; exit 1; } ;;
esac
"""


def test_the_command_asks_for_the_count_on_the_directory_given():
    d = Path("/lustre/runs/r1/checkpoints")
    assert stripe_command(d, 4) == ["lfs", "setstripe", "-c", "4", "--", str(d)]
    assert stripe_command(d, -1) == ["lfs", "setstripe", "-c", "-1", "--", str(d)]
    assert stripe_command(d, 0) is None  # the filesystem's default is kept


@pytest.fixture
def lfs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "lfs"
    tool.write_text(FAKE_LFS)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "lfs.log"
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LFS_LOG": str(log)}, log


def _prepare(tmp_path, env, **checkpoint):
    tmp_path.mkdir(exist_ok=True)
    cfg = small_config(tmp_path, "r1", checkpoint=checkpoint)
    return cli("prepare", "--config", write_config(tmp_path / "r1.yaml", **cfg), env=env)


def test_on_lustre_the_new_checkpoints_directory_is_striped(tmp_path, lfs):
    env, log = lfs
    res = _prepare(tmp_path, {**env, "FAKE_LUSTRE": "1"})
    assert res.returncode == 0, res.stderr
    asked = log.read_text().splitlines()
    assert len(asked) == 2 and asked[0].startswith("getstripe -d -- "), asked
    where = asked[1].removeprefix("setstripe -c 4 -- ")
    assert where != asked[1] and where == asked[0].removeprefix("getstripe -d -- ")
    # set on the run's checkpoints/ while the run was still being made (then renamed)
    made = Path(where)
    assert made.name == "checkpoints" and made.parent.name.startswith(".r1.creating-")
    assert made.parent.parent == tmp_path / "runs"
    assert "checkpoints/ striped over 4 OSTs" in res.stderr
    assert (tmp_path / "runs" / "r1" / "checkpoints").is_dir()


def test_every_ost_and_the_default_left_alone(tmp_path, lfs):
    env, log = lfs
    res = _prepare(tmp_path, {**env, "FAKE_LUSTRE": "1"}, lustre_stripe_count=-1)
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines()[1].startswith("setstripe -c -1 -- ")
    assert "striped over every OST" in res.stderr
    log.unlink()
    res = _prepare(tmp_path / "again", {**env, "FAKE_LUSTRE": "1"}, lustre_stripe_count=0)
    assert res.returncode == 0, res.stderr
    assert not log.exists() and "striped" not in res.stderr  # lfs never asked


def test_off_lustre_nothing_is_set_or_said(tmp_path, lfs):
    env, log = lfs
    res = _prepare(tmp_path, env)
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["getstripe"]
    assert "checkpoints/" not in res.stderr


def test_a_refused_setstripe_is_said_and_the_run_is_made_whole(tmp_path, lfs):
    env, log = lfs
    res = _prepare(tmp_path, {**env, "FAKE_LUSTRE": "1", "FAKE_SET_FAILS": "1"})
    assert res.returncode == 0, res.stderr
    assert ("checkpoints/ keeps Lustre's default layout: lfs setstripe failed "
            "(lfs setstripe: Operation not permitted)") in res.stderr
    run = tmp_path / "runs" / "r1"
    assert (run / "config.yaml").is_file() and (run / "data" / "manifest.json").is_file()


def test_a_bad_count_is_one_line_and_nothing_is_made(tmp_path, lfs):
    env, log = lfs
    res = _prepare(tmp_path, {**env, "FAKE_LUSTRE": "1"}, lustre_stripe_count=5000)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "checkpoint.lustre_stripe_count: 5000" in res.stderr
    assert not (tmp_path / "runs").exists() and not log.exists()
