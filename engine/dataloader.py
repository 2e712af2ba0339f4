"""The training data loader `initialize(training_data=...)` returns, with a resumable position.

Built by `engine/engine.py`; saved and restored by `engine/checkpoint/` through `state_dict()` /
`load_state_dict()`. It is a plain `torch.utils.data.DataLoader` over a `DistributedSampler` (seeded by
`config.seed`, batch size = `train_micro_batch_size_per_gpu`), extended with one thing torch lacks: a
position that does not depend on the world size. The sampler orders each epoch with one global seeded
permutation and deals it out round-robin to the ranks, so "global samples consumed in this epoch" says
exactly which samples are left, at any world size (a resume at another world size with the same
global batch continues with the same batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

_END = object()  # the end of an epoch's batches


def timed_batches(batches: Iterator[Any], fetch_timer: Callable[[], AbstractContextManager[Any]]) -> Iterator[Any]:
    """Each batch of `batches`, each fetch inside `fetch_timer()` (the engine's "data" phase); shared by
    this loader and the curriculum loader (engine/data_sampling.py)."""
    while True:
        with fetch_timer():
            batch = next(batches, _END)
        if batch is _END:
            return
        yield batch


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` (drop_last) that can start an epoch after `start` global samples."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0  # global samples of this epoch already consumed

    def _global_order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        return order[: n - n % self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        rest = self._global_order()[self.start :]
        return iter(rest[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        return (n - n % self.num_replicas - self.start) // self.num_replicas


class TrainingDataLoader(DataLoader):
    """One epoch per iteration, from the saved position; `epoch` and `samples_consumed` (global, this
    epoch) advance as batches are handed out."""

    def __init__(self, dataset: Dataset, *, batch_size: int, sampler: ResumableDistributedSampler, **kwargs: Any):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.epoch = 0
        self.samples_consumed = 0
        # Set by the engine that owns this loader: a context manager timing each batch fetch (the
        # "data" phase of its StepMetrics).
        self.fetch_timer: Callable[[], AbstractContextManager[Any]] = nullcontext

    def __iter__(self) -> Iterator[Any]:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        sampler.set_epoch(self.epoch)
        sampler.start = self.samples_consumed
        for batch in timed_batches(super().__iter__(), self.fetch_timer):
            self.samples_consumed += self.batch_size * sampler.num_replicas  # type: ignore[operator]
            yield batch
        self.epoch += 1
        self.samples_consumed = 0

    def state_dict(self) -> dict[str, int]:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed, "seed": sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        if int(state["seed"]) != sampler.seed:
            raise ValueError(
                f"seed: the checkpoint's data order used seed {state['seed']}, this run {sampler.seed}; "
                "resume with the same seed"
            )
        self.epoch = int(state["epoch"])
        self.samples_consumed = int(state["samples_consumed"])


def build_dataloader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    num_replicas: int,
    rank: int,
    seed: int,
    collate_fn: Any = None,
) -> TrainingDataLoader:
    """The loader over `dataset` for this data-parallel rank."""
    sampler = ResumableDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, seed=seed)
    # An own generator: without it every new iterator draws its base seed from the global torch RNG, so
    # a resumed run (which opens one iterator more) would shift the model's random stream (dropout).
    generator = torch.Generator().manual_seed(seed)
    return TrainingDataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, generator=generator
    )
