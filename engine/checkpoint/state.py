"""What goes into a checkpoint besides the sharded tensors: RNG streams, data position, engine counters.

Caller: api.py, which splits an engine's state three ways:
- tensors (model + optimizer, from the ZeRO strategy's `state_dict()`): written sharded by DCP (io.py);
- per-rank state (`rank<r>.pt`): the python, numpy and torch (and CUDA, when present) RNG states of
  that rank, so dropout continues the same stream after a resume at the same world size;
- shared state (`engine_state.pt`, rank 0): step counters, LR scheduler, loss scaler, data position
  and the user's client_state.

Both small files are written with `torch.save` and read with `torch.load(weights_only=True)`: only
tensors, numbers, strings and containers, never arbitrary pickled objects. That is why the numpy RNG
state is stored as a tensor plus numbers rather than as numpy's own tuple.

When a checkpoint is loaded at a larger world size, the new ranks have no saved RNG state; each gets
a stream derived from rank 0's saved state and its own rank (`derived_rng_seed`), so it is
deterministic and differs between ranks (ranks must not draw identical dropout masks).
"""

from __future__ import annotations

import hashlib
import io
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepfleet.engine.checkpoint.layout import CheckpointError, atomic_write

ENGINE_STATE = "engine_state.pt"


def rank_file(rank: int) -> str:
    """Name of the per-rank state file of `rank`."""
    return f"rank{rank}.pt"


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python `random`, numpy's global generator, torch CPU (and CUDA)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNG states to `state` (from `capture_rng`)."""
    random.setstate(_as_python_state(state["python"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            torch.cuda.manual_seed_all(int(torch.randint(0, 2**62, (1,)).item()))


def _as_python_state(s: Any) -> tuple:
    # torch.load(weights_only=True) returns the nested tuples as saved; lists appear if saved from JSON.
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def derived_rng_seed(source: dict[str, Any], *, rank: int) -> int:
    """A seed for a rank that has no saved RNG state: a hash of rank 0's saved torch state and the rank."""
    h = hashlib.sha256(source["torch"].numpy().tobytes())
    h.update(f"rank{rank}".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (and CUDA) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class DataPosition:
    """Where the training data stream stands, independent of the world size.

    `samples_in_epoch` counts samples consumed in the current epoch over all data-parallel ranks, so a
    resume at another world size (same global batch) continues with the same global batches.
    """

    epoch: int
    samples_in_epoch: int
    seed: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        return cls(epoch=int(d["epoch"]), samples_in_epoch=int(d["samples_in_epoch"]), seed=int(d["seed"]))


def save_small(path: Path, obj: Any) -> None:
    """torch.save `obj` to `path` atomically, checking first that it loads back with weights_only=True."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # translate the unpickler's complaint into which file and what to change
        raise CheckpointError(
            f"{path.name}: holds a value that cannot be restored safely ({e}); keep client_state and "
            "scheduler state to tensors, numbers, strings, lists, tuples and dicts"
        ) from e
    atomic_write(path, data)


def load_small(path: Path) -> Any:
    """Read a file written by `save_small`; CheckpointError names the file if it cannot be read."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # torch raises several types for a damaged zip/pickle
        raise CheckpointError(f"{path}: unreadable ({e})") from e
