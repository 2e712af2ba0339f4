"""FSDP2's all-gather and reduce-scatter as all-reduces (`engine/zero/fsdp_collectives.py`) against torch's
own collectives, at 2 and 3 gloo ranks, on shard sizes that divide nothing (including empty shards), in
fp32 and bf16, called the way FSDP2 calls them; and a whole FSDP2 model trained with them against one
trained with torch's defaults."""

from __future__ import annotations

import pytest

from tests.spawn import spawn

SIZES = (0, 1, 7, 1001)


def _collectives_match(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from deepfleet.engine.zero.fsdp_collectives import AllReduceAllGather, AllReduceReduceScatter

    group = dist.group.WORLD
    gather, scatter = AllReduceAllGather(), AllReduceReduceScatter()
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            gen = torch.Generator().manual_seed(1000 * rank + n)
            shard = torch.randn(n, generator=gen).to(dtype)
            expected = torch.empty(n * world, dtype=dtype)
            dist.all_gather_single(expected, shard, group=group)

            # FSDP2 copies its input into the output in place, then passes a view of the output.
            out = gather.allocate((n * world,), dtype=dtype, device=torch.device("cpu"))
            out.fill_(float("nan"))  # stale memory must not leak into the result
            out.narrow(0, rank * n, n).copy_(shard)
            work = gather(out, out.narrow(0, rank * n, n), group, async_op=True)
            work.wait()
            assert torch.equal(out, expected), (dtype, n, "in-place all-gather")

            separate = torch.full((n * world,), 3.0, dtype=dtype)
            assert gather(separate, shard.clone(), group) is None
            assert torch.equal(separate, expected), (dtype, n, "all-gather")

            full = torch.randn(n * world, generator=gen).to(dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                reference = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_single(reference, full.clone(), op=op, group=group)
                got = scatter.allocate((n,), dtype=dtype, device=torch.device("cpu"))
                assert scatter(got, full.clone(), group, op) is None
                torch.testing.assert_close(got, reference, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
                pending_out = torch.empty(n, dtype=dtype)
                scatter(pending_out, full.clone(), group, op, async_op=True).wait()
                assert torch.equal(pending_out, got), (dtype, n, op, "async reduce-scatter")
            checked.append(f"{dtype}:{n}")
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_and_reduce_scatter_equal_torch_collectives(world_size: int) -> None:
    results = spawn(_collectives_match, world_size)
    assert all(len(r) == 2 * len(SIZES) for r in results)


def _train(rank: int, world: int, custom: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from deepfleet.engine.zero.fsdp_collectives import AllReduceAllGather, AllReduceReduceScatter

    torch.manual_seed(0)
    # Row counts 5, 7, 11 and 1 shard unevenly at 2 and 3 ranks (padding, and an empty shard at 3).
    model = nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 11),
                          nn.Linear(11, 1))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    units = [model[1], model[2]]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if custom:
        for unit in [*units, model]:
            unit.set_custom_all_gather(AllReduceAllGather())
            unit.set_custom_reduce_scatter(AllReduceReduceScatter())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 3, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_training_with_all_reduce_collectives_equals_default(world_size: int) -> None:
    import torch

    ours = spawn(_train, world_size, True)[0]
    default = spawn(_train, world_size, False)[0]
    assert ours.keys() == default.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], default[name], rtol=1e-6, atol=1e-7, msg=name)
