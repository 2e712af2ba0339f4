"""Sequence sharding for sequence parallelism: each `sp` rank gets its contiguous slice of every sequence.

Callers: training scripts and the engine's users with `sequence_parallel_size > 1`, wrapping the loader
`initialize` returns (`SequenceParallelLoader(loader, group=engine.parallel.submesh("sp").get_group())`);
the ranks of one `sp` group sit at the same data-parallel rank, so they load the same samples, and this
adapter keeps each rank's 1/p of the tokens, the order Ulysses and ring attention expect (rank r holds
positions [r * S/p, (r + 1) * S/p)). Every tensor of a batch (a tensor, a tuple/list, or a dict) is
sliced along `seq_dim`; its length there must divide by p (pad to a multiple of p, or of p * block for
block-sparse layouts, first). Labels for next-token prediction must be shifted before sharding, since a
shard's last label is the next shard's first token. A tensor with no `seq_dim` (a per-sample scalar)
passes through; `keys` restricts the slicing to some dict entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from deepfleet.engine import comm


def shard_sequence(batch: Any, *, rank: int, world: int, seq_dim: int = 1, keys: set[str] | None = None) -> Any:
    """Rank `rank`'s 1/world slice of every tensor in `batch` along `seq_dim` (see the module docstring)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            return batch
        length = batch.shape[seq_dim]
        if length % world:
            raise ValueError(f"sequence length {length} (dim {seq_dim}) does not divide over {world} "
                             f"sequence-parallel ranks; pad it to a multiple of {world}")
        return batch.narrow(seq_dim, rank * (length // world), length // world)
    if isinstance(batch, dict):
        return {k: v if keys is not None and k not in keys else
                shard_sequence(v, rank=rank, world=world, seq_dim=seq_dim) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(shard_sequence(v, rank=rank, world=world, seq_dim=seq_dim, keys=keys) for v in batch)
    return batch


class SequenceParallelLoader:
    """Wraps an iterable of batches; yields this rank's sequence shard of each (len() is the wrapped one's)."""

    def __init__(self, loader: Iterable, *, group=None, seq_dim: int = 1, keys: set[str] | None = None) -> None:
        self.loader = loader
        self.group = group
        self.seq_dim = seq_dim
        self.keys = keys

    def __iter__(self) -> Iterator[Any]:
        rank, world = comm.get_rank(self.group), comm.get_world_size(self.group)
        for batch in self.loader:
            yield shard_sequence(batch, rank=rank, world=world, seq_dim=self.seq_dim, keys=self.keys)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
