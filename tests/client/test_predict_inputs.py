"""`predict --input`: an .npz is read by the run's data.x_key, and the hints name what
predict takes (never 'synthetic', which only training understands)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import cli, train_tiny


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("pin"), "pin")


def test_predict_on_an_npz_equals_the_same_rows_as_npy(trained, tmp_path):
    x = np.random.default_rng(1).standard_normal((24, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, y=np.zeros(24, np.float32))
    np.save(tmp_path / "in.npy", x)
    outs = []
    for name in ("in.npz", "in.npy"):
        done = cli("predict", trained, "--input", tmp_path / name, "--procs-per-node", "1",
                   "--name", name.replace(".", "-"))
        assert done.returncode == 0, done.stderr[-2000:]
        out = tmp_path / f"{name}.out.npy"
        assert cli("collect", trained, "--name", name.replace(".", "-"), "--out", out).returncode == 0
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_npz_without_the_key_and_missing_input_name_the_fix(trained, tmp_path):
    np.savez(tmp_path / "other.npz", features=np.zeros((4, 8), np.float32))
    done = cli("predict", trained, "--input", tmp_path / "other.npz", "--procs-per-node", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "has no array 'x'" in done.stderr and "features" in done.stderr
    missing = cli("predict", trained, "--input", tmp_path / "nope.npy")
    assert missing.returncode == 2 and "--input:" in missing.stderr
    assert "synthetic" not in missing.stderr
