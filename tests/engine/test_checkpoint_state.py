"""Per-rank and shared checkpoint state (engine/checkpoint/state.py): RNG streams round-trip through
the safe (weights_only) file format, new ranks get distinct deterministic streams, unsafe values are
refused at save time."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from deepfleet.engine.checkpoint.layout import CheckpointError
from deepfleet.engine.checkpoint.state import (
    capture_rng,
    derived_rng_seed,
    load_small,
    restore_rng,
    save_small,
)


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), float(np.random.randn())


def test_rng_round_trips_through_a_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    save_small(tmp_path / "rank0.pt", {"rng": capture_rng()})
    expected = _draw()
    _draw()
    restore_rng(load_small(tmp_path / "rank0.pt")["rng"])
    assert _draw() == expected


def test_derived_seeds_are_deterministic_and_distinct() -> None:
    torch.manual_seed(0)
    source = capture_rng()
    seeds = [derived_rng_seed(source, rank=r) for r in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [derived_rng_seed(source, rank=r) for r in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)


class _Custom:
    """An arbitrary user object: picklable, but not loadable with weights_only=True."""


@pytest.mark.parametrize("value", [_Custom(), lambda: 1], ids=["custom-class", "unpicklable"])
def test_unsafe_values_are_refused_at_save(tmp_path: Path, value) -> None:
    with pytest.raises(CheckpointError, match="engine_state.pt: holds a value that cannot be restored safely"):
        save_small(tmp_path / "engine_state.pt", {"client_state": {"obj": value}})
    assert not (tmp_path / "engine_state.pt").exists()


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "rank1.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"rank1.pt: unreadable"):
        load_small(tmp_path / "rank1.pt")
    with pytest.raises(CheckpointError, match=r"rank2.pt: missing"):
        load_small(tmp_path / "rank2.pt")
