"""Rank functions for the sequence-parallel tests (module level, so spawn can import them)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepfleet.engine.attention.data import SequenceParallelLoader
from deepfleet.engine.attention.ring import ring_attention
from deepfleet.engine.attention.sparse_self_attention import SparseSelfAttention
from deepfleet.engine.attention.sparsity_config import BigBirdSparsityConfig
from deepfleet.engine.attention.ulysses import DistributedAttention, ulysses_attention
from deepfleet.kernels.block_sparse_attention import block_sparse_attention, layout_blocks


def _sdpa(causal: bool):
    def attn(q, k, v):  # (B, h, S, D)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return attn


def _compare(rank: int, world: int, *, heads: int, kv_heads: int, run, reference, seq: int = 16) -> float:
    """Max abs difference of this rank's output shard and input-shard gradients against one process."""
    torch.manual_seed(0)
    q = torch.randn(2, seq, heads, 8, dtype=torch.float64)  # (B, S, H, D): every rank draws the same tensors
    k = torch.randn(2, seq, kv_heads, 8, dtype=torch.float64)
    v = torch.randn(2, seq, kv_heads, 8, dtype=torch.float64)
    dy = torch.randn(2, seq, heads, 8, dtype=torch.float64)
    shard = slice(rank * seq // world, (rank + 1) * seq // world)
    local = [t[:, shard].clone().requires_grad_() for t in (q, k, v)]
    out = run(*local)
    grads = torch.autograd.grad(out, local, dy[:, shard])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*full)
    ref_grads = torch.autograd.grad(ref, full, dy)
    errs = [(out - ref[:, shard]).abs().max()]
    errs += [(g - r[:, shard]).abs().max() for g, r in zip(grads, ref_grads, strict=True)]
    return max(e.item() for e in errs)


def _bhsd(attn):
    """attention on (B, h, S, D) -> the same on (B, S, h, D)."""
    return lambda q, k, v: attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def attention_cases(rank: int, world: int) -> dict[str, float]:
    group = dist.group.WORLD
    out: dict[str, float] = {}
    for causal in (False, True):
        out[f"ulysses causal={causal}"] = _compare(
            rank, world, heads=4, kv_heads=4, run=lambda q, k, v, c=causal: ulysses_attention(q, k, v, _sdpa(c), group=group),
            reference=_bhsd(_sdpa(causal)))
    out["ulysses gqa kv_heads=1"] = _compare(
        rank, world, heads=4, kv_heads=1, run=lambda q, k, v: ulysses_attention(q, k, v, _sdpa(True), group=group),
        reference=_bhsd(_sdpa(True)))
    out["ulysses gqa kv_heads=2"] = _compare(
        rank, world, heads=4, kv_heads=2, run=lambda q, k, v: ulysses_attention(q, k, v, _sdpa(False), group=group),
        reference=_bhsd(_sdpa(False)))
    random.seed(0)  # the same random blocks on every rank
    layout = BigBirdSparsityConfig(2, block=4, num_random_blocks=1).make_layout(16)
    rows, cols = layout_blocks(layout)

    def sparse(q, k, v):  # (B, 2, S, D)
        return block_sparse_attention(q, k, v, rows, cols, block=4)
    out["ulysses block-sparse"] = _compare(
        rank, world, heads=4, kv_heads=4, run=lambda q, k, v: ulysses_attention(q, k, v, sparse, group=group),
        reference=_bhsd(_layout_dense(layout)))
    for causal in (False, True):
        out[f"ring heads=3 causal={causal}"] = _compare(
            rank, world, heads=3, kv_heads=3, run=lambda q, k, v, c=causal: ring_attention(q, k, v, group=group, causal=c),
            reference=_bhsd(_sdpa(causal)), seq=14)
    out["ring gqa heads=3 kv=1"] = _compare(
        rank, world, heads=3, kv_heads=1, run=lambda q, k, v: ring_attention(q, k, v, group=group, causal=True),
        reference=_bhsd(_sdpa(True)))

    def seq_first(q, k, v):  # DeepSpeed's (S, B, h, D) layout
        return _sdpa(True)(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)
    wrapper = DistributedAttention(seq_first, group, scatter_idx=2, gather_idx=0)
    out["DistributedAttention (s, b, h, d)"] = _compare(
        rank, world, heads=4, kv_heads=4,
        run=lambda q, k, v: wrapper(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1),
        reference=_bhsd(_sdpa(True)))
    return out


def _layout_dense(layout):
    from deepfleet.kernels.block_sparse_attention import expand_layout

    mask = expand_layout(layout, 4)  # (2, S, S): the same layout for head pairs (0,1) and (2,3) after a2a
    def attn(q, k, v):  # (B, 4, S, D) on one process: heads 0,1 -> layout heads 0,1; heads 2,3 -> 0,1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(2, 1, 1))
    return attn


def layout_broadcast_and_loader(rank: int, world: int) -> dict:
    random.seed(100 + rank)  # different random blocks on each rank until the first forward
    attn = SparseSelfAttention(BigBirdSparsityConfig(2, block=2, num_random_blocks=2), max_seq_length=32)
    before = attn.master_layout.clone()
    x = torch.randn(1, 2, 32, 4)
    attn(x, x, x)
    gathered = [torch.zeros_like(before) for _ in range(world)]
    dist.all_gather(gathered, attn.master_layout)
    batches = [{"input_ids": torch.arange(8).reshape(1, 8) + 10 * i, "n": torch.tensor(i)} for i in range(2)]
    shards = list(SequenceParallelLoader(batches, group=dist.group.WORLD))
    return {"same": all(torch.equal(g, gathered[0]) for g in gathered), "changed": not torch.equal(before, gathered[0]),
            "shards": [s["input_ids"].tolist() for s in shards], "n": [int(s["n"]) for s in shards]}


class _SPModel(torch.nn.Module):
    """One attention layer whose attention runs Ulysses over `sp_group` (None: one process, whole sequences);
    forward(batch) -> mean squared error over this rank's tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)
        self.proj = torch.nn.Linear(16, 16)
        self.sp_group = None

    def forward(self, batch: dict) -> torch.Tensor:
        x, y = batch["x"], batch["y"]  # (B, s, 16)
        q, k, v = (t.reshape(*x.shape[:2], 4, 4) for t in self.qkv(x).chunk(3, dim=-1))  # (B, s, H, D)
        if self.sp_group is None:
            a = _bhsd(_sdpa(True))(q, k, v)
        else:
            a = ulysses_attention(q, k, v, _sdpa(True), group=self.sp_group)
        return ((self.proj(a.reshape(*x.shape)) - y) ** 2).mean()


def _sp_batches() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(2, 12, 16, generator=g), "y": torch.randn(2, 12, 16, generator=g)} for _ in range(2)]


def _sp_reference() -> dict:
    model = _SPModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in _sp_batches():
        model(batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sp_engine_stages(rank: int, world: int) -> dict[int, float]:
    """sequence_parallel_size=world with ZeRO stages 0-3: parameters after 2 steps vs one process."""
    import deepfleet.engine as deepspeed
    from deepfleet.engine.attention.data import shard_sequence

    ref = _sp_reference()
    out = {}
    for stage in (0, 1, 2, 3):
        model = _SPModel()
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5),  # linear in the gradient: Adam would amplify rounding in tiny gradients
            config={"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": world,
                    "zero_optimization": {"stage": stage}})
        assert engine.parallel.sp == world and engine.parallel.dp_size == 1
        sp = engine.parallel.submesh("sp")
        model.sp_group = sp.get_group()
        for batch in _sp_batches():
            loss = engine(shard_sequence(batch, rank=sp.get_local_rank(), world=world))
            engine.backward(loss)
            engine.step()
        state = engine.sharding.state_dict()["model"]
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in state.items()}
        out[stage] = max((full[k].float() - ref[k]).abs().max().item() for k in ref)
    return out
