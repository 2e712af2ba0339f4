"""`deepspeed.utils.RepeatingLoader` (also `deepspeed.runtime.dataloader.RepeatingLoader`): iterate a
data loader forever, restarting it when it is exhausted — what pipeline scripts hand `train_batch`.
A restart calls `set_epoch(n)` on a sampler that has it (torch's DistributedSampler and the engine's
loader), so each pass is a new shuffle."""

from __future__ import annotations

from typing import Any


class RepeatingLoader:
    """Wraps an iterable (a data loader) so that `next()` never raises StopIteration."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            for owner in (self.loader, getattr(self.loader, "sampler", None)):
                if hasattr(owner, "set_epoch"):
                    owner.set_epoch(self.epoch)
                    break
            self.data_iter = iter(self.loader)
            return next(self.data_iter)

    def __len__(self) -> int:
        return len(self.loader)
