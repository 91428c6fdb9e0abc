"""A run directory is untrusted input: every reader opens its files through
storage/run_files.py, so a FIFO, /dev/zero, a directory, a symlink loop or a symlink out of
the run is one line naming the file (or a CORRUPT step for `verify`), never a hang and never
an OK."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from enn_cluster.errors import UserError
from enn_cluster.storage.run_files import (
    append_run_file,
    check_run_file,
    read_run_bytes,
    read_run_text,
)
from helpers import cli, train_tiny


def _plant(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to(path.name)  # a loop


@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO"), ("devzero", "a symbolic link"),
                                         ("dir", "a directory"), ("loop", "a symbolic link")])
def test_what_is_not_a_regular_file_is_refused_by_name_without_blocking(tmp_path, kind, words):
    path = tmp_path / "run.lock"
    _plant(path, kind)  # a FIFO with no writer: a plain open() would wait for ever
    with pytest.raises(UserError, match=f"^run.lock: {path} is {words}, not a regular file"):
        read_run_bytes(path)


def test_a_regular_file_is_read_whole_and_capped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    assert read_run_text(path) == '{"step": 1}\n'
    with pytest.raises(UserError, match="more than the 4 such a file can hold"):
        read_run_bytes(path, limit=4)
    with pytest.raises(FileNotFoundError):
        read_run_bytes(tmp_path / "absent")


@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO"), ("devzero", "a symbolic link"),
                                         ("dir", "a directory"), ("loop", "a symbolic link")])
def test_a_writer_never_blocks_on_a_fifo_nor_writes_through_a_symlink(tmp_path, kind, words):
    """The workers append metrics.jsonl and jobs.jsonl: opening a FIFO to write waits for a
    reader, for ever; a symlink would send the lines elsewhere. resume checks first."""
    path = tmp_path / "metrics.jsonl"
    _plant(path, kind)
    with pytest.raises(UserError, match=f"^metrics.jsonl: {path} is {words}"):
        append_run_file(path)
    with pytest.raises(UserError, match=f"^metrics.jsonl: {path} is {words}"):
        check_run_file(path)
    fresh = tmp_path / "jobs.jsonl"
    check_run_file(fresh)  # absent is fine
    with append_run_file(fresh) as fh:
        fh.write("{}\n")
    check_run_file(fresh)
    assert fresh.read_text() == "{}\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("runfiles"), "h")


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run, run / "checkpoints" / "step-2"


def _verify(run: Path):
    done = cli("verify", run, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done


@pytest.mark.parametrize("what", ["shard", "step"])
def test_verify_fails_a_shard_or_step_that_is_a_symlink_out_of_the_run(trained, tmp_path, what):
    """The bytes outside are the very same (checksums agree): only where they lie is wrong."""
    run, step = _copy(trained, tmp_path)
    outside = tmp_path / "outside"
    if what == "step":
        shutil.move(step, outside)
        step.symlink_to(outside)
    else:
        shard = next(step.glob("*.distcp"))
        outside.mkdir()
        shutil.move(shard, outside / shard.name)
        shard.symlink_to(outside / shard.name)
    done = _verify(run)
    assert done.returncode == 1 and "step-2: CORRUPT" in done.stdout, done.stdout
    assert ("leads outside" if what == "shard" else "a symbolic link") in done.stdout


@pytest.mark.parametrize("name", ["__0_0.distcp", "rng/rank-0.pt"])
def test_status_and_doctor_take_a_committed_file_that_loops_for_damage(trained, tmp_path, name):
    """Found by the sweep of every run file x every read-only command: a symlink loop in place
    of a file the commit records was an ELOOP traceback in the cheap committed-step check."""
    run, step = _copy(trained, tmp_path)
    (step / name).unlink()
    _plant(step / name, "loop")
    for argv in (["status", run], ["doctor", run]):
        done = cli(*argv, timeout=120)
        assert "Traceback" not in done.stderr and done.returncode in (0, 1), done.stderr[-2000:]
    assert "step-2" not in cli("status", run, timeout=120).stdout.split("checkpoints:")[-1][:80]


@pytest.mark.parametrize("name,kind", [("backend-rank-0.json", "fifo"),
                                       ("backend-rank-0.json", "devzero"),
                                       ("exit-rank-0.json", "deep")])
def test_status_and_doctor_skip_a_damaged_rank_record(trained, tmp_path, name, kind):
    """Found by the sweep: a FIFO or /dev/zero as a rank's backend report hung status and
    doctor; deeply nested JSON as its exit record was a RecursionError traceback."""
    run, _ = _copy(trained, tmp_path)
    for path in (run / "logs").glob(f"*/{name}"):
        path.unlink()
        if kind == "deep":
            path.write_text("[" * 100000 + "]" * 100000)
        else:
            _plant(path, kind)
    for argv in (["status", run], ["doctor", run]):
        done = cli(*argv, timeout=120)
        assert "Traceback" not in done.stderr and done.returncode in (0, 1), done.stderr[-2000:]


@pytest.mark.parametrize("name", ["commit.json", "__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("kind", ["fifo", "devzero", "dir", "loop"])
def test_verify_names_a_checkpoint_file_that_is_not_a_file(trained, tmp_path, name, kind):
    run, step = _copy(trained, tmp_path)
    (step / name).unlink()
    _plant(step / name, kind)
    done = _verify(run)
    assert done.returncode in (1, 2), done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "step-2: OK" not in said and (name in said or "commit record" in said), said
    if kind == "fifo":  # status and export read the same files: neither hangs nor crashes
        for argv in (["status", run], ["export", run, "--out", tmp_path / "artifact"]):
            done = cli(*argv, timeout=120)
            assert "Traceback" not in done.stderr and done.returncode in (0, 2), done.stderr
        assert not (tmp_path / "artifact").exists()
    if kind == "fifo" and name == "__0_0.distcp":  # doctor calls it a problem, not "no checkpoint"
        done = cli("doctor", run, timeout=120)
        assert done.returncode == 1 and "__0_0.distcp" in done.stdout and "a FIFO" in done.stdout


def test_verify_names_an_unknown_checksum_algorithm(trained, tmp_path):
    run, step = _copy(trained, tmp_path)
    record = json.loads((step / "commit.json").read_text())
    record["files"][".metadata"]["checksum"] = "sha0:00"
    (step / "commit.json").write_text(json.dumps(record))
    done = _verify(run)
    assert done.returncode == 1 and "unknown checksum algorithm 'sha0'" in done.stdout


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_rng_state_ends_resume_with_exit_2_and_one_line(trained, tmp_path):
    """rng/rank-0.pt is unpickled weights-only by the worker: a pickle that would run a
    command (its commit record forged to match) ends the attempt once, exit 2, one line."""
    import pickle

    from enn_cluster.storage.checksum import file_checksum

    run, step = _copy(trained, tmp_path)
    marker = tmp_path / "MARKER"
    rng = step / "rng" / "rank-0.pt"
    rng.write_bytes(pickle.dumps({"cpu": _Payload(marker)}))
    record = json.loads((step / "commit.json").read_text())
    size, checksum = file_checksum(rng)
    record["files"]["rng/rank-0.pt"] = {"size": size, "checksum": checksum}
    (step / "commit.json").write_text(json.dumps(record))
    done = cli("resume", run, "--set", "training.max_steps=3", timeout=240, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "rng/rank-0.pt" in line]
    assert len(said) == 1 and "Unsupported" in said[0], done.stderr[-3000:]
    assert not marker.exists()


def test_a_tampered_model_pickle_runs_nothing_under_doctor_or_export(trained, tmp_path):
    """A config.yaml pointing at a pickle that would run a command, its commit record forged
    to match: export refuses it in one line (exit 2), doctor reports it as a problem, and
    the command never runs."""
    import pickle

    import yaml

    from enn_cluster.storage.model_structure import FACTORY, write_structure

    run, _ = _copy(trained, tmp_path)
    marker = tmp_path / "MARKER"
    write_structure(run / "model.pkl", pickle.dumps(_Payload(marker)))
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"].update(name=FACTORY, kwargs={"path": str(run / "model.pkl")})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    done = cli("export", run, "--out", tmp_path / "artifact", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("enn-submit: error: model.kwargs.path")
    assert "posix.system" in done.stderr and not (tmp_path / "artifact").exists()
    done = cli("doctor", run, timeout=120)
    assert done.returncode == 1 and "refers to posix.system" in done.stdout, done.stdout
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["file", "loop"])
def test_checkpoints_that_is_no_directory_is_one_line_in_status_verify_and_export(
        trained, tmp_path, kind):
    """Issue 38 section 4: a regular file or a symlink loop where checkpoints/ should be was
    a NotADirectoryError / ELOOP traceback; now one line naming it, exit 2."""
    run, _ = _copy(trained, tmp_path)
    shutil.rmtree(run / "checkpoints")
    if kind == "file":
        (run / "checkpoints").write_text("not a folder")
    else:
        os.symlink(run / "checkpoints", run / "checkpoints")
    for args in (("status", run), ("verify", run), ("export", run, "--out", tmp_path / "out")):
        done = cli(*args, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "checkpoints" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()
