"""Checksums name their algorithm: new records use xxh3, old crc32 records still verify."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from enn_cluster.storage import commits as store
from enn_cluster.storage.checksum import RunningChecksum, algorithm_of, bytes_checksum, file_checksum


def test_file_and_stream_checksums_agree_and_catch_one_flipped_bit(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, (9 << 20) + 17, dtype=np.uint8)
    path = tmp_path / "f.bin"
    data.tofile(path)
    running = RunningChecksum()
    for start in range(0, data.size, 1 << 20):
        running.update(data[start:start + (1 << 20)])
    size, whole = file_checksum(path)
    assert (size, whole) == (data.size, running.hexdigest()) == (data.size, bytes_checksum(data))
    assert whole.startswith("xxh3:") and len(whole) == len("xxh3:") + 16
    data[123456] ^= 1
    assert bytes_checksum(data) != whole


def test_crc32_records_still_verify(tmp_path):
    payload = b"checkpoint bytes" * 1000
    (tmp_path / "a.distcp").write_bytes(payload)
    old = f"crc32:{zlib.crc32(payload):08x}"
    assert file_checksum(tmp_path / "a.distcp", like=old) == (len(payload), old)
    record = {"files": {"a.distcp": {"size": len(payload), "checksum": old}}}
    assert store.verify_files(tmp_path, ["a.distcp"], record) == []
    (tmp_path / "a.distcp").write_bytes(payload[:-1] + b"!")
    assert "checksum" in store.verify_files(tmp_path, ["a.distcp"], record)[0]


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="md5"):
        algorithm_of("md5:abc")
    assert json.dumps(algorithm_of(None)) == '"xxh3"'


def test_a_prediction_staged_with_crc32_is_still_recognised(tmp_path):
    """Re-asking for a prediction made before xxh3 compares inputs by recomputing the
    staged input's checksum with the new algorithm."""
    from enn_cluster.storage import prediction_manifest as pm
    from enn_cluster.client.prediction_request import _input_checksum
    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.storage.staging import stage_array

    x = np.random.default_rng(1).standard_normal((50, 3)).astype(np.float32)
    run = RunDir(tmp_path / "run")
    (run.predictions / "old").mkdir(parents=True)
    entry = stage_array(x, run.predictions / "old" / pm.INPUT)
    old = {"name": "old", "input": {"checksum": f"crc32:{zlib.crc32(x.tobytes()):08x}"}}
    assert _input_checksum(run, old, like=entry["checksum"]) == entry["checksum"]
    other = stage_array(x + 1, tmp_path / "other.npy")
    assert _input_checksum(run, old, like=other["checksum"]) != other["checksum"]
    same_algo = {"name": "old", "input": {"checksum": entry["checksum"]}}
    assert _input_checksum(run, same_algo, like=other["checksum"]) == entry["checksum"]
