"""The stage-1/2 partition layout (engine/zero/layout.py) in one process: every rank's view of a
bucket is built side by side, so packing, segments and unpacking are checked for all ranks at once
without a process group (the collectives themselves are exercised in test_partitioned.py)."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine.zero.layout import Bucket, build_buckets, local_rows, make_slot

SHAPES = [(1,), (5, 3), (7,), (), (4, 2, 3), (2,), (3, 1), (0, 4)]


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rows_split_like_dtensor_shard_0(world_size: int) -> None:
    """Rank r owns rows [r*c, min((r+1)*c, d)), c = ceil(d/N): torch.chunk's split, which is what
    DTensor Shard(0) and FSDP2 use, so checkpoints reshard across stages 1, 2 and 3."""
    for shape in SHAPES:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        rows = full.reshape(-1, *shape[1:])  # a 0-dim tensor lays out as one row
        chunks = list(torch.chunk(rows, world_size)) if rows.shape[0] else []
        for rank in range(world_size):
            slot = make_slot("p", torch.Size(shape), offset=0, world_size=world_size, rank=rank)
            expected = chunks[rank] if rank < len(chunks) else rows[:0]
            assert torch.equal(local_rows(full, slot), expected.reshape(slot.local_shape)), (shape, rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_pack_gives_each_rank_its_rows_and_unpack_inverts_it(world_size: int) -> None:
    tensors = _tensors()
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    ranks = [Bucket(named, world_size=world_size, rank=r) for r in range(world_size)]
    flat = torch.full((ranks[0].flat_numel,), float("nan"))
    for i, t in enumerate(tensors):
        ranks[0].pack(flat, i, t)
    assert not flat.isnan().any()  # padding was zeroed, nothing left uninitialized
    seg = ranks[0].segment_numel
    for r, bucket in enumerate(ranks):
        segment = flat[r * seg : (r + 1) * seg]  # what reduce-scatter leaves on rank r
        for i, (slot, t) in enumerate(zip(bucket.slots, tensors, strict=True)):
            assert torch.equal(bucket.segment_view(segment, i), local_rows(t, slot))
    rebuilt = [torch.full_like(t, float("nan")) for t in tensors]
    for i, t in enumerate(rebuilt):
        ranks[0].unpack(flat, i, t)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, tensors, strict=True))


def test_missing_gradient_packs_as_zeros() -> None:
    t = torch.randn(5, 3)
    bucket = Bucket([("a", t), ("b", t)], world_size=3, rank=0)
    flat = torch.full((bucket.flat_numel,), 7.0)
    bucket.pack(flat, 0, t)
    bucket.pack(flat, 1, None)
    out = torch.empty_like(t)
    bucket.unpack(flat, 1, out)
    assert torch.equal(out, torch.zeros_like(t))
    bucket.unpack(flat, 0, out)
    assert torch.equal(out, t)


def test_fill_segment_zeroes_padding() -> None:
    t = torch.randn(7)  # 3 ranks: rows 3, 3, 1 — rank 2's shard has two padding elements
    bucket = Bucket([("c", t)], world_size=3, rank=2)
    segment = torch.full((bucket.segment_numel,), float("nan"))
    bucket.fill_segment(segment, [local_rows(t, bucket.slots[0])])
    assert torch.equal(segment, torch.cat([t[6:], torch.zeros(2)]))


def test_buckets_follow_reverse_order_size_and_dtype() -> None:
    params = [
        ("a", torch.zeros(4, 4)),
        ("b", torch.zeros(4, 4)),
        ("c", torch.zeros(4, 4, dtype=torch.bfloat16)),
        ("d", torch.zeros(40)),
        ("e", torch.zeros(2)),
    ]
    buckets = build_buckets(params, bucket_numel=32, world_size=2, rank=0)
    names = [[s.name for s in b.slots] for b in buckets]
    # reverse registration order; "d" alone exceeds the size; the bf16 "c" cannot share a buffer
    assert names == [["e"], ["d"], ["c"], ["b", "a"]]
    assert all(len({p.dtype for p in b.params}) == 1 for b in buckets)
    # offsets are contiguous, padded shards
    ba = buckets[-1]
    assert [s.offset for s in ba.slots] == [0, 8] and ba.segment_numel == 16 and ba.flat_numel == 32


def test_pack_accepts_a_non_contiguous_gradient() -> None:
    grad = torch.randn(3, 5).t()  # (5, 3), transposed strides, as a user's grad hook may return
    assert not grad.is_contiguous()
    bucket = Bucket([("b", torch.zeros(5, 3))], world_size=2, rank=0)
    flat = torch.empty(bucket.flat_numel)
    bucket.pack(flat, 0, grad)
    out = torch.empty(5, 3)
    bucket.unpack(flat, 0, out)
    assert torch.equal(out, grad)
