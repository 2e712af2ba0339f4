"""DP-SGD: per-sample gradient clipping, Gaussian noise and a privacy accountant (the
`deepfleet_differential_privacy` config section, engine/config_privacy.py).

Built by `initialize` when the section is enabled; the engine calls `after_backward()` after every
micro-batch's backward and `finish()` on the accumulation boundary, before the strategy's
`finish_gradients`.

Why Opacus, and which part of it. Per-sample gradients come from Opacus' `GradSampleModule` hooks
(activations captured in forward, per-sample weight gradients formed from them and the backprops in
backward). That path keeps DeepSpeed's protocol — the user computes the loss and calls
`engine.backward(loss)` — while a `torch.func` `vmap(grad)` path would need the engine to own the loss
function. The hooks sit on the user's submodules, not on a wrapper, so the ZeRO strategy still wraps the
plain model (DDP at stage 0, our flat-buffer partitioning at stages 1 and 2) and parameter names stay
the model's. Opacus' own optimizer and `DPDDP` are not used: the noise and the reduction are ours so
they go through the strategy's reduction. The accountants are Opacus' (RDP and PRV).

How it composes with data parallelism. Clipping needs every parameter's per-sample gradient, so no
reduction may see a gradient before `finish()`: with DP the engine turns gradient sync off on every
micro-step (stage 0's DDP does not communicate; stage 2 accumulates locally and reduces at the
boundary, as with `deepfleet_local_grad_accumulation`). `after_backward()` replaces each micro-batch's
gradient with the sum of its clipped per-sample gradients; `finish()` writes, on every rank,

    grad_r = S_r * W / B  +  z / B,    z ~ N(0, sigma^2 C^2), drawn from the same seed on every rank,

with S_r the rank's sum of clipped per-sample gradients, W the data-parallel size and B the global batch
(`train_batch_size`). The strategy's reduction averages over the W ranks, giving (sum_r S_r + z) / B:
exactly one noise draw per step, the same value a single process computes from the same batch and seed.
Stage 0's DDP strategy does not reduce after backward, so here the all-reduce of S_r is done in
`finish()` (sum, then (S + z) / B on every rank). Stage 3 (FSDP2) reduce-scatters each parameter's
gradient as its backward completes, before the per-sample norm over all parameters is known, so it is
refused by name.

Sampling. The accountant assumes each example joins a step's batch independently with probability
`sample_rate` (default train_batch_size / dataset_size); the engine's loader draws shuffled fixed-size
batches, the usual approximation of that (Opacus' own non-Poisson mode). Only float32/bfloat16
training: fp16 loss scaling with skipped steps would break the one-draw-per-step accounting.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm


def build_privacy(
    config: Any, model: nn.Module, sharding: Any, *, group: Any, dp_size: int, dataset_size: int | None,
) -> DPSGD | None:
    """The DP-SGD state for `config.deepfleet_differential_privacy`, or None when it is disabled.
    Raises ValueError naming the key when the run cannot be private as configured."""
    section = config.deepfleet_differential_privacy
    if not section.enabled:
        return None
    stage = config.zero_optimization.stage
    if stage == 3:
        raise ValueError(
            "deepfleet_differential_privacy.enabled: not supported at zero_optimization.stage 3 (FSDP2 reduces each "
            "gradient before the per-sample norm over all parameters is known); use stage 0, 1 or 2"
        )
    if config.fp16.enabled:
        raise ValueError("deepfleet_differential_privacy.enabled: not supported with fp16 (skipped overflow steps break "
                         "the accounting); use bf16 or fp32")
    if config.gradient_clipping:
        raise ValueError("deepfleet_differential_privacy.enabled: gradient_clipping is set; per-sample clipping is "
                         "deepfleet_differential_privacy.max_grad_norm, set gradient_clipping to 0")
    if getattr(getattr(config, "eigenvalue", None), "enabled", False):
        raise ValueError("deepfleet_differential_privacy.enabled: not supported with eigenvalue (its Hessian-vector "
                         "products would run through the per-sample hooks); disable one of them")
    sample_rate = section.sample_rate
    if sample_rate is None:
        n = section.dataset_size or dataset_size
        if n is None:
            raise ValueError("deepfleet_differential_privacy.sample_rate: unset and no dataset size is known; set "
                             "sample_rate or dataset_size, or pass training_data to initialize")
        if config.train_batch_size > n:
            raise ValueError(f"deepfleet_differential_privacy.dataset_size: {n} is smaller than train_batch_size "
                             f"{config.train_batch_size}; set the real dataset size")
        sample_rate = config.train_batch_size / n
    return DPSGD(model, sharding, section=section, sample_rate=sample_rate, batch_size=config.train_batch_size,
                 gradient_accumulation_steps=config.gradient_accumulation_steps, group=group, dp_size=dp_size,
                 reduce_here=stage == 0)


@contextlib.contextmanager
def _quiet_orders() -> Iterator[None]:
    """Opacus' RDP accountant warns when the best order is at the end of its default range (very few
    or very many steps); the epsilon it returns is still a valid upper bound."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        yield


def make_accountant(kind: str) -> Any:
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if kind == "rdp" else PRVAccountant()


class DPSGD:
    """Per-sample clipping and noising of one engine's gradients, and its privacy accounting."""

    def __init__(self, model: nn.Module, sharding: Any, *, section: Any, sample_rate: float, batch_size: int,
                 gradient_accumulation_steps: int, group: Any, dp_size: int, reduce_here: bool) -> None:
        from opacus import GradSampleModule

        self.max_grad_norm = float(section.max_grad_norm)
        self.delta = float(section.delta)
        self.sample_rate = float(sample_rate)
        self.batch_size = batch_size
        self.gas = gradient_accumulation_steps
        self.group = group
        self.dp_size = dp_size
        self.reduce_here = reduce_here
        self.secure_rng = bool(section.secure_rng)
        self.seed = int(section.seed)
        self.accountant_kind = section.accountant
        if section.noise_multiplier is not None:
            self.noise_multiplier = float(section.noise_multiplier)
        else:
            from opacus.accountants.utils import get_noise_multiplier

            steps = int(round(section.epochs / self.sample_rate))
            with _quiet_orders():  # the search visits noise levels whose optimum is an extreme order
                self.noise_multiplier = float(get_noise_multiplier(
                    target_epsilon=section.target_epsilon, target_delta=self.delta, sample_rate=self.sample_rate,
                    steps=steps, accountant=self.accountant_kind))
        self.accountant = make_accountant(self.accountant_kind)
        self.steps = 0
        # hooks on the user's submodules; the wrapper itself is never called (the strategy wraps `model`)
        try:
            self._grad_sample = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        except NotImplementedError as e:
            raise ValueError(f"deepfleet_differential_privacy.enabled: the model has a layer without per-sample "
                             f"gradients ({e}); freeze it or replace it") from None
        self._names = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.params = list(self._names.values())
        self._sums: list[torch.Tensor | None] = [None] * len(self.params)
        if hasattr(sharding, "local_accumulation"):
            sharding.local_accumulation = True  # stage 2: no reduction inside backward

    # --- per micro-batch --------------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def backward_context() -> Iterator[None]:
        """Around the backward: the per-sample hooks of a first layer (whose input needs no gradient)
        fire on its output gradients, as intended; torch warns about that on every call."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            yield

    def after_backward(self) -> None:
        """Clip this micro-batch's per-sample gradients to `max_grad_norm` and add their sum to the
        window's; the plain gradient the backward accumulated is dropped."""
        samples = [p.grad_sample for p in self.params]
        missing = [i for i, s in enumerate(samples) if s is None]
        n = next(s.shape[0] for s in samples if s is not None)
        for name, p in self._names.items():
            if p.grad_sample is not None and p.grad_sample.shape[0] != n:
                raise ValueError(
                    f"deepfleet_differential_privacy.enabled: parameter {name} got {p.grad_sample.shape[0]} per-sample "
                    f"gradients for a batch of {n} (its layer's input has no batch dimension, e.g. a position "
                    "embedding called on arange(seq)); freeze it or give its input the batch dimension")
        with torch.no_grad():
            # the engine divided the loss by the accumulation steps; per-sample gradients are undone of it
            flat = [s.reshape(n, -1).float() * self.gas for s in samples if s is not None]
            norms = torch.cat([f.pow(2).sum(1, keepdim=True) for f in flat], 1).sum(1).sqrt()
            factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            for i in range(len(self.params)):
                if i in missing:
                    continue
                clipped = torch.einsum("n,n...->...", factor, samples[i].float() * self.gas)
                self._sums[i] = clipped if self._sums[i] is None else self._sums[i].add_(clipped)
        for p in self.params:
            p.grad_sample = None
            p.grad = None
        self.last_clipped_fraction = float((norms > self.max_grad_norm).float().mean())

    # --- on the boundary --------------------------------------------------------------------------

    def finish(self) -> None:
        """Write each parameter's noised gradient for the strategy to reduce (see the module docstring)."""
        generator = self._generator()
        sums = [s if s is not None else torch.zeros_like(p, dtype=torch.float32)
                for s, p in zip(self._sums, self.params, strict=True)]
        if self.reduce_here and self.dp_size > 1:
            flat = torch.cat([s.reshape(-1) for s in sums])
            comm.all_reduce(flat, group=self.group)
            sums = list(torch.split(flat, [s.numel() for s in sums]))
            scale = 1.0
        else:
            scale = float(self.dp_size)
        std = self.noise_multiplier * self.max_grad_norm
        with torch.no_grad():
            for p, s in zip(self.params, sums, strict=True):
                noise = torch.normal(0.0, std, size=p.shape, generator=generator, dtype=torch.float32)
                g = (s.reshape(p.shape) * scale + noise.to(s.device)) / self.batch_size
                p.grad = g.to(p.dtype)
        self._sums = [None] * len(self.params)
        self.steps += 1
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    def _generator(self) -> torch.Generator:
        """The step's noise source, identical on every rank (CPU generator: device-independent draws)."""
        if self.secure_rng:
            seed = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 1], dtype=torch.int64)
            if self.dp_size > 1:  # one rank's entropy for all, so the noise stays a single draw
                comm.broadcast(seed, group=self.group, group_src=0)
            value = int(seed.item())
        else:
            value = self.seed + self.steps
        return torch.Generator(device="cpu").manual_seed(value)

    # --- reporting --------------------------------------------------------------------------------

    def epsilon(self) -> float:
        """Epsilon spent so far at `delta` (0 before the first step)."""
        if self.steps == 0:
            return 0.0
        with _quiet_orders():
            return float(self.accountant.get_epsilon(delta=self.delta))

    def state_dict(self) -> dict:
        return {"steps": self.steps, "history": list(self.accountant.history)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.accountant.history = [tuple(h) for h in state["history"]]

