"""`deepspeed.zero.Init` partitions parameters while the model is built: each rank keeps its rows, the
whole model never exists on one rank, and `initialize` hands the rows to ZeRO-3 (or makes them whole at
stages 0-2) with the same training as a model built without it; `GatheredParameters` works on them."""

from __future__ import annotations

import torch
from torch import nn

import deepfleet.engine as deepspeed
from examples.gpt.model import GPTConfig, TinyGPT
from tests.spawn import spawn

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


class Scaled(nn.Linear):
    """A subclass that changes its weights after super().__init__: partitioning must wait for it."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        with torch.no_grad():
            self.weight.fill_(0.5)


class GPTLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(CFG)
        self.extra = Scaled(CFG.vocab_size)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.extra(self.gpt(batch[:, :-1]))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)[rank * 2:(rank + 1) * 2]


def _build(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    whole = GPTLoss()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        parted = GPTLoss()
    out = {"empty": all(p.numel() == 0 for p in parted.parameters() if p.dim() > 0), "rows_match": True,
           "bytes": sum(p.ds_tensor.numel() for p in parted.parameters() if hasattr(p, "ds_tensor")),
           "whole_bytes": sum(p.numel() for p in whole.parameters() if p.dim() > 0),
           "ds_shape": parted.gpt.head.weight.ds_shape, "status": parted.gpt.head.weight.ds_status.name}
    for (name, p), q in zip(parted.named_parameters(), whole.parameters(), strict=True):
        if not torch.equal(p.ds_tensor, torch.chunk(q.detach(), world)[rank]):
            out["rows_match"] = False
            out["bad"] = name
    # GatheredParameters: whole inside, rank 0's change reaches every rank's rows
    w = parted.gpt.head.weight
    with deepspeed.zero.GatheredParameters(w, modifier_rank=0):
        out["gathered_equal"] = torch.equal(w.detach(), whole.gpt.head.weight.detach())
        if rank == 0:
            w.data.fill_(2.0)
    out["after"] = bool((w.ds_tensor == 2.0).all()) and w.numel() == 0
    return out


def test_parameters_are_partitioned_as_their_modules_are_built() -> None:
    results = spawn(_build, 2)
    for r, res in enumerate(results):
        assert res["empty"] and res["rows_match"], res
        assert res["ds_shape"] == (CFG.vocab_size, CFG.d_model) and res["status"] == "NOT_AVAILABLE"
        assert res["gathered_equal"] and res["after"], r
    # the ranks' rows together are the model: each holds about half
    assert sum(r["bytes"] for r in results) == results[0]["whole_bytes"]
    assert max(r["bytes"] for r in results) <= 0.55 * results[0]["whole_bytes"]


def _train(rank: int, world: int, stage: int, use_init: bool) -> list[float]:
    torch.manual_seed(0)
    if use_init:
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": stage}}):
            model = GPTLoss()
    else:
        model = GPTLoss()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    losses = []
    for step in range(3):
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_model_built_under_init_trains_like_one_built_without() -> None:
    for stage in (3, 2):
        plain = spawn(_train, 2, stage, False)
        parted = spawn(_train, 2, stage, True)
        for a, b in zip(parted, plain, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (stage, a, b)
