"""DeepSpeed's five LR schedules as torch `LRScheduler` subclasses.

Called by `deepfleet.engine.build` (`build_lr_scheduler(optimizer, config.scheduler)`); the engine
steps the schedule once per optimizer step. Torch has no WarmupLR/WarmupDecayLR/WarmupCosineLR/
OneCycle/LRRangeTest with DeepSpeed's parameters and curves, so they are written here on torch's
`LRScheduler` (state_dict round trip, `get_last_lr()`, the optimizer-step ordering check).

Step convention (DeepSpeed's): `last_batch_iteration` starts at -1 and each `step()` adds one; the
rate of the optimizer step that follows is f(last_batch_iteration). Torch's `LRScheduler` applies a
first step at construction (`last_epoch` 0), so here `last_batch_iteration = last_epoch - 1`.

Per-group behaviour: a rate given as one number applies to every group, a list (WarmupLR,
WarmupDecayLR, LRRangeTest, as DeepSpeed allows) gives one per group; an unset
`WarmupLR.warmup_max_lr` and the ratio schedule (`WarmupCosineLR`) use each group's own initial
lr, so param groups with different base rates keep their ratio. Deliberate differences to
DeepSpeed, both at edges: OneCycle keeps each group's beta2 (DeepSpeed forces 0.99) and cycles
`momentum` for optimizers without `betas` (DeepSpeed then disables cycling); WarmupCosineLR starts
at `warmup_min_ratio` (DeepSpeed applies 0 before its first step).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from deepfleet.engine.config_optim import (
    LRRangeTestConfig,
    OneCycleConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
)

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_lr_scheduler"]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig | None) -> LRScheduler | None:
    """The schedule `config` names over `optimizer`, or None without a `scheduler` section."""
    if config is None:
        return None
    p = config.params
    if isinstance(config, WarmupDecayLRConfig):
        return WarmupDecayLR(optimizer, total_num_steps=p.total_num_steps, warmup_min_lr=p.warmup_min_lr,
                             warmup_max_lr=p.warmup_max_lr, warmup_num_steps=p.warmup_num_steps,
                             warmup_type=p.warmup_type, last_batch_iteration=p.last_batch_iteration)
    if isinstance(config, WarmupLRConfig):
        return WarmupLR(optimizer, warmup_min_lr=p.warmup_min_lr, warmup_max_lr=p.warmup_max_lr,
                        warmup_num_steps=p.warmup_num_steps, warmup_type=p.warmup_type,
                        last_batch_iteration=p.last_batch_iteration)
    if isinstance(config, WarmupCosineLRConfig):
        return WarmupCosineLR(optimizer, total_num_steps=p.total_num_steps, warmup_min_ratio=p.warmup_min_ratio,
                              warmup_num_steps=p.warmup_num_steps, cos_min_ratio=p.cos_min_ratio,
                              warmup_type=p.warmup_type, last_batch_iteration=p.last_batch_iteration)
    if isinstance(config, OneCycleConfig):
        return OneCycle(optimizer, **p.model_dump())
    if isinstance(config, LRRangeTestConfig):
        return LRRangeTest(optimizer, **p.model_dump())
    raise TypeError(f"build_lr_scheduler: unsupported scheduler config {type(config).__name__}")


class _StepSchedule(LRScheduler):
    """Base: subclasses give `_lr(base_lr)` at `self.last_batch_iteration`."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_epoch=-1)  # applies f(-1), the rate of the first optimizer step
        if last_batch_iteration >= 0:  # resuming: continue the curve where it was
            self.last_epoch = last_batch_iteration + 1
            self._apply(self.get_lr())

    @property
    def last_batch_iteration(self) -> int:
        """Index of the last step taken (-1 before the first `step()`)."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return [self._lr(group, base_lr) for group, base_lr in enumerate(self.base_lrs)]

    def _lr(self, group: int, base_lr: float) -> float:
        """The rate of param group `group` (initial lr `base_lr`) at `self.last_batch_iteration`."""
        raise NotImplementedError

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = list(lrs)


def _per_group(value: float | list[float] | None, optimizer: torch.optim.Optimizer, name: str) -> list:
    """A scalar for every param group, or the given list checked against the number of groups."""
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} param groups; give one per group or one number")
        return list(value)
    return [value] * count


def _warmup_fraction(iteration: int, *, warmup_steps: int, warmup_type: str) -> float:
    """0 -> 1 over warmup: log(i + 1) / log(W) or i / W (W >= 2)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class WarmupLR(_StepSchedule):
    """Rise from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    lr(i) = min + (max - min) * gamma(i), gamma = log(i + 1) / log(W) (`log`) or i / W (`linear`)
    for i < W, else 1; W = max(2, warmup_num_steps); lr(-1) = min. `warmup_max_lr=None` means each
    group's initial lr.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type: {warmup_type!r} is not 'log' or 'linear'")
        if warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps: must be > 0, got {warmup_num_steps}")
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration=last_batch_iteration)

    def _gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return _warmup_fraction(i, warmup_steps=self.warmup_num_steps, warmup_type=self.warmup_type)
        return 1.0

    def _lr(self, group: int, base_lr: float) -> float:
        low, high = self.min_lrs[group], self.max_lrs[group]
        if self.last_batch_iteration < 0:
            return low
        top = base_lr if high is None else high
        return low + (top - low) * self._gamma()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay: gamma(i) = max(0, (T - i) / max(1, T - W)) for i >= W."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0, warmup_max_lr: float | list[float] | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type,
                         last_batch_iteration=last_batch_iteration)

    def _gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_StepSchedule):
    """Ratio of each group's initial lr: warmup from `warmup_min_ratio` to 1, then cosine to `cos_min_ratio`.

    Warmup (i < W): r = min_ratio + (1 - min_ratio) * gamma(i) as in WarmupLR. After:
    p = min(1, (i - W + 1) / max(1, T - W)); r = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type: {warmup_type!r} is not 'log' or 'linear'")
        if warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps: must be > 0, got {warmup_num_steps}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration=last_batch_iteration)

    def _ratio(self) -> float:
        i, warm = self.last_batch_iteration, self.warmup_num_steps
        if i < 0:
            return self.warmup_min_ratio
        if i < warm:
            gamma = _warmup_fraction(i, warmup_steps=warm, warmup_type=self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (i - warm + 1) / max(1, self.total_num_steps - warm))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0

    def _lr(self, group: int, base_lr: float) -> float:
        return base_lr * self._ratio()


class LRRangeTest(_StepSchedule):
    """lr(i) = min_lr * (1 + step_rate * x), x = (i + 1) / step_size, floored when `staircase`."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.min_lrs = _per_group(lr_range_test_min_lr, optimizer, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration=last_batch_iteration)

    def _lr(self, group: int, base_lr: float) -> float:
        x = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            x = math.floor(x)
        return self.min_lrs[group] * (1.0 + self.step_rate * x)


class OneCycle(_StepSchedule):
    """One triangular cycle of the lr (momentum inversely), then optional decay.

    With b = i + 1, first half F, second half S, total C = F + S: in the cycle (i < C) the scale s
    rises 0 -> 1 over F and falls 1 -> 0 over S (in `stair_count` flat stairs per half when given);
    lr = min + (max - min) * s, momentum = max_mom - (max_mom - min_mom) * s. After the cycle, with
    d = i - C + 1 steps since its end: lr = min / (1 + decay_lr_rate * d / decay_step_size) and
    momentum = max_mom * (1 + decay_mom_rate * d / decay_step_size) (held when decay_step_size is 0).
    Momentum is beta1 of `betas` (beta2 kept), or `momentum` for optimizers without betas.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.first_size = cycle_first_step_size
        self.second_size = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        defaults = optimizer.defaults
        self.momentum_key = ("betas" if "betas" in defaults else "momentum" if "momentum" in defaults else None)
        self.cycle_momentum = cycle_momentum and self.momentum_key is not None
        super().__init__(optimizer, last_batch_iteration=last_batch_iteration)

    @property
    def total_size(self) -> int:
        return self.first_size + self.second_size

    def _scale(self) -> float:
        b = (self.last_batch_iteration + 1) % self.total_size  # position in the cycle, integer
        if b <= self.first_size:
            position, size, stairs = b, self.first_size, self.first_stairs
        else:
            position, size, stairs = self.total_size - b, self.second_size, self.second_stairs
        if stairs > 0:  # integer arithmetic keeps stairs exact at the half-cycle boundaries
            return math.floor(position * stairs / size) / stairs
        return position / size

    def _decay_steps(self) -> int | None:
        """Steps since the end of the cycle, or None while inside it."""
        i = self.last_batch_iteration
        return None if i < self.total_size else i - self.total_size + 1

    def _lr(self, group: int, base_lr: float) -> float:
        after = self._decay_steps()
        if after is None:
            return self.min_lr + (self.max_lr - self.min_lr) * self._scale()
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return self.min_lr
        return self.min_lr / (1.0 + self.decay_lr_rate * after / self.decay_step_size)

    def momentum(self) -> float:
        """The momentum (beta1) for the current step."""
        after = self._decay_steps()
        if after is None:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.max_mom
        return self.max_mom * (1.0 + self.decay_mom_rate * after / self.decay_step_size)

    def _apply(self, lrs: list[float]) -> None:
        super()._apply(lrs)
        self._apply_momentum()

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._apply_momentum()

    def _apply_momentum(self) -> None:
        if not self.cycle_momentum:
            return
        mom = self.momentum()
        for group in self.optimizer.param_groups:
            if self.momentum_key == "betas":
                group["betas"] = (mom, group["betas"][1])
            else:
                group["momentum"] = mom
