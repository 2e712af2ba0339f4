"""AdamW step time on the CPU: torch's `fused=True` path vs its `foreach` path vs deepfleet's reference
AdamW (`deepfleet.kernels.fused_adamw` with DEEPFLEET_KERNELS=torch) vs the engine's optimizer as the
config builds it (`FusedAdamW`, kernels on auto), for a few model sizes.

Run by `benchmarks/run_all.py` (`make bench`) or alone: `python benchmarks/optim_step.py [--quick]`.
Prints one JSON line per size: the median seconds per step of each implementation (interleaved rounds,
so machine noise hits all alike) and each one's speed relative to `foreach`. The parameters are shaped
like a GPT's (embedding, then per layer a fused QKV, a projection and a 4x MLP, with biases and norms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepfleet.engine.optim import FusedAdamW  # noqa: E402
from deepfleet.kernels._dispatch import force_impl  # noqa: E402
from deepfleet.kernels.fused_adamw import fused_adamw  # noqa: E402

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def gpt_shapes(d: int, layers: int, vocab: int = 8192) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes


class _Reference:
    """The kernel's pure-torch specification, stepping each group like an optimizer would."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        with force_impl("torch"):
            fused_adamw(self.params, [p.grad for p in self.params], self.m, self.v, lr=HP["lr"], betas=HP["betas"],
                        eps=HP["eps"], weight_decay=HP["weight_decay"], step=self.t)


def _make(kind: str, shapes: list[tuple[int, ...]]) -> tuple[Callable[[], None], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    if kind == "foreach":
        opt = torch.optim.AdamW(params, **HP, foreach=True)
    elif kind == "fused":
        opt = torch.optim.AdamW(params, **HP, fused=True)
    elif kind == "reference":
        opt = _Reference(params)
    else:
        opt = FusedAdamW(params, **HP)
    return opt.step, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small sizes, few steps")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [(256, 4), (512, 8)] if args.quick else [(256, 4), (512, 8), (768, 12)]
    kinds = ("foreach", "fused", "reference", "deepfleet")
    for d, layers in sizes:
        shapes = gpt_shapes(d, layers)
        steps = {k: _make(k, shapes) for k in kinds}
        n_params = sum(p.numel() for p in steps["foreach"][1])
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for k in kinds:  # warm-up: state allocation happens on the first step
            steps[k][0]()
        for _ in range(args.rounds):
            for k in kinds:
                start = time.perf_counter()
                steps[k][0]()
                times[k].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({
            "bench": "optim_step", "device": "cpu", "threads": 1, "params": n_params, "tensors": len(shapes),
            "step_s": {k: round(v, 5) for k, v in med.items()},
            "speed_vs_foreach": {k: round(med["foreach"] / v, 3) for k, v in med.items()},
        }), flush=True)


if __name__ == "__main__":
    main()
