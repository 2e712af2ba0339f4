"""Models, batches and a single-process reference shared by the ZeRO stage 1/2 tests.

`OddModel` has parameters whose dim 0 (1, 3, 5, 7) does not divide evenly by 2 or 3 ranks, plus a
0-dim parameter; `gpt()` is the example TinyGPT at a size that steps in milliseconds.
"""

from __future__ import annotations

import torch
from torch import nn

from deepfleet.engine.config_zero import ZeroConfig
from deepfleet.engine.zero.partitioned import ZeroStage2
from deepfleet.engine.zero.stage1 import ZeroStage1
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

STAGES = {1: ZeroStage1, 2: ZeroStage2}
GPT = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
LR = 1e-3


class OddModel(nn.Module):
    """Odd dim-0 sizes and a 0-dim parameter; forward(batch) -> scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)  # weight (3, 4), bias (3,)
        self.a = nn.Parameter(torch.randn(1, 3))
        self.b = nn.Parameter(torch.randn(5, 4))
        self.c = nn.Parameter(torch.randn(7))
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"]  # (batch, 4)
        h = torch.tanh(self.lin(x)) * self.a  # (batch, 3)
        z = torch.tanh(x @ self.b.T)  # (batch, 5)
        w = x.sum(-1, keepdim=True) * self.c  # (batch, 7)
        y = h.sum(-1) * self.s + z.sum(-1) - batch["y"]  # (batch,)
        return y.pow(2).mean() + 0.1 * torch.tanh(w).pow(2).mean()


def make_model(kind: str, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPTWithLoss(GPT) if kind == "gpt" else OddModel()


def global_batch(kind: str, size: int, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """One deterministic global batch of `size` samples."""
    if kind == "gpt":
        data = SyntheticTokens(num_samples=size, seq_len=GPT.seq_len, vocab_size=GPT.vocab_size, seed=seed)
        rows = [data[i] for i in range(size)]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(size, 4, generator=g), "y": torch.randn(size, generator=g)}


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    n = next(iter(batch.values())).shape[0] // world_size
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def zero_config(stage: int, *, bucket: int = 2000, overlap: bool = True, local_accumulation: bool = False) -> ZeroConfig:
    """Small buckets so even the tiny models span several of them."""
    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=bucket,
        allgather_bucket_size=bucket,
        overlap_comm=overlap,
        deepfleet_local_grad_accumulation=local_accumulation,
    )


def build(
    kind: str,
    stage: int,
    *,
    dtype: torch.dtype = torch.float32,
    bucket: int = 2000,
    overlap: bool = True,
    seed: int = 0,
    local_accumulation: bool = False,
):
    """A model, its stage-1/2 strategy and AdamW over the strategy's tensors."""
    model = make_model(kind, seed=seed)
    config = zero_config(stage, bucket=bucket, overlap=overlap, local_accumulation=local_accumulation)
    strategy = STAGES[stage](model, compute_dtype=dtype, zero_config=config)
    groups = strategy.optimizer_param_groups([{"params": list(model.parameters())}])
    optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)
    strategy.bind_optimizer(optimizer)
    return model, strategy, optimizer


def reference_step(
    kind: str, batch: dict[str, torch.Tensor], *, micro_steps: int = 1, max_norm: float = 0.0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """Single-process AdamW on the whole global batch: (params after, grads before the step, norm)."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    n = next(iter(batch.values())).shape[0] // micro_steps
    for m in range(micro_steps):
        (model({k: v[m * n : (m + 1) * n] for k, v in batch.items()}) / micro_steps).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = float(
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    )
    optimizer.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}, grads, norm


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ (0 when both are zero)."""
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    denom = float(b.norm())
    diff = float((a - b).norm())
    return diff / denom if denom else diff


def portable(tree):
    """Tensors -> fp32 numpy arrays, recursively, so results cross process boundaries by value
    (a torch tensor would travel as a shared-memory handle that dies with the rank process)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().float().numpy().copy()
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(portable(v) for v in tree)
    return tree


def step_err(after, ref_after: torch.Tensor, ref_grad: torch.Tensor, *, steps: int = 1) -> float:
    """Relative error of updated parameters over the elements whose reference gradient is above float
    noise. A mathematically zero gradient (e.g. attention's key bias, which softmax ignores) is ~1e-9
    of rounding noise in both runs, and Adam's g / sqrt(v) turns any noise into a full lr-sized step,
    so those elements are only held to |difference| <= 2 * lr per step (early Adam steps move a weight
    by at most about lr)."""
    after = torch.as_tensor(after).float().reshape(ref_after.shape)
    g = ref_grad.abs()
    keep = g > 1e-4 * g.max() if g.numel() and g.max() > 0 else torch.zeros_like(g, dtype=torch.bool)
    noise = float((after - ref_after)[~keep].abs().max()) if (~keep).any() else 0.0
    assert noise <= 2 * LR * steps + 1e-7, noise
    return rel_err(after[keep], ref_after[keep]) if keep.any() else 0.0


def rows_err(rows, ref_grad: torch.Tensor, start: int) -> float:
    """Error of one rank's gradient rows relative to the whole reference gradient's norm (a row block
    may be all noise, like the key bias, where a per-block ratio means nothing)."""
    full = ref_grad.reshape(-1, *ref_grad.shape[1:])  # 0-dim -> (1,)
    rows = torch.as_tensor(rows).float()
    block = full[start : start + rows.shape[0]]
    denom = float(full.norm())
    diff = float((rows.reshape(block.shape) - block).norm())
    return diff / denom if denom else diff


def reference_run(
    kind: str, batches: list[dict[str, torch.Tensor]], *, max_norm: float = 0.0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    """Single-process AdamW, one step per global batch: (params after, last grads, pre-clip norms)."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        model(batch).backward()
        limit = max_norm if max_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        optimizer.step()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return {k: p.detach().clone() for k, p in model.named_parameters()}, grads, norms
