"""Dataset fingerprints (file, directory, sample stream) and their way into the worker's heartbeats."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from deepfleet.engine import provenance


@pytest.fixture(autouse=True)
def _fresh():
    provenance.clear()
    yield
    provenance.clear()


def test_fingerprints_are_stable_and_change_with_the_data(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_bytes(b"alpha")
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(b"\x00\x01")
    first = provenance.fingerprint(tmp_path / "d")
    assert first == provenance.fingerprint(str(tmp_path / "d")) and first.startswith("sha256:")
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(b"\x00\x02")
    assert provenance.fingerprint(tmp_path / "d") != first
    (tmp_path / "d" / "sub" / "b.bin").rename(tmp_path / "d" / "b.bin")  # same bytes, another place
    assert provenance.fingerprint(tmp_path / "d") != first
    one = tmp_path / "d" / "a.txt"
    expected = hashlib.sha256()
    expected.update(b"s5:a.txt")
    expected.update(b"f5:alpha")
    assert provenance.fingerprint(one) == "sha256:" + expected.hexdigest()
    samples = [torch.arange(4), {"text": "hi", "label": 1}]
    assert provenance.fingerprint(samples) == provenance.fingerprint(list(samples))
    assert provenance.fingerprint(samples) != provenance.fingerprint(samples[::-1])
    assert provenance.fingerprint([torch.arange(4)]) != provenance.fingerprint([torch.arange(4.0)])
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        provenance.fingerprint(tmp_path / "missing")
    with pytest.raises(TypeError, match="cannot hash a object"):
        provenance.fingerprint([object()])


def test_reported_datasets_and_torch_version_ride_in_heartbeats(tmp_path: Path) -> None:
    from deepfleet.worker.heartbeat import HeartbeatReporter, HeartbeatSink
    from deepfleet.worker.spec import HeartbeatSpec

    data = tmp_path / "train.bin"
    data.write_bytes(b"tokens")
    digest = provenance.record_dataset(str(data))
    provenance.record_dataset("s3://bucket/val", "md5:1234")
    sink = HeartbeatSink(HeartbeatReporter(HeartbeatSpec(url=None)))
    beat = sink.heartbeat()
    assert beat.torch_version == torch.__version__
    assert [(d.uri, d.digest) for d in beat.datasets] == sorted([("s3://bucket/val", "md5:1234"), (str(data), digest)])
    assert digest == provenance.fingerprint(data)
    with pytest.raises(ValueError, match="uri is empty"):
        provenance.record_dataset("")
