"""FSDP2's reduce-scatter as a ring of sends (`engine/zero/fsdp_collectives.py`) against torch's own
reduce-scatter, at 2 and 3 gloo ranks, on shard sizes that divide nothing (including empty shards), in fp32
and bf16, SUM and AVG, called the way FSDP2 calls it; and a whole FSDP2 model trained with it against one
trained with torch's default."""

from __future__ import annotations

import pytest

from tests.spawn import spawn

SIZES = (0, 1, 7, 1001)


def _reduce_scatter_matches(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from deepfleet.engine.zero.fsdp_collectives import RingReduceScatter

    group = dist.group.WORLD
    scatter = RingReduceScatter()
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            gen = torch.Generator().manual_seed(1000 * rank + n)
            full = torch.randn(n * world, generator=gen).to(dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                reference = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_single(reference, full.clone(), op=op, group=group)
                got = scatter.allocate((n,), dtype=dtype, device=torch.device("cpu"))
                got.fill_(float("nan"))  # stale memory must not leak into the result
                assert scatter(got, full.clone(), group, op) is None
                # Three ranks may add in another order than gloo: fp32 rounding, bf16 rounding.
                tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
                torch.testing.assert_close(got, reference, rtol=tol, atol=tol, msg=f"{dtype} n={n} {op}")
                if world == 2 and dtype == torch.float32:
                    assert torch.equal(got, reference)  # a + b is one rounding whatever the order
            checked.append(f"{dtype}:{n}")
    return checked


def _refuses_bad_input(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    from deepfleet.engine.zero.fsdp_collectives import ring_reduce_scatter

    try:
        ring_reduce_scatter(torch.empty(3), torch.empty(3 * world + 1), group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ring_reduce_scatter_equals_torch_reduce_scatter(world_size: int) -> None:
    results = spawn(_reduce_scatter_matches, world_size)
    assert all(len(r) == 2 * len(SIZES) for r in results)


@pytest.mark.slow
def test_ring_reduce_scatter_refuses_a_mis_sized_input() -> None:
    assert spawn(_refuses_bad_input, 2) == ["reduce-scatter input has 7 elements, expected 2 x 3"] * 2


def _train(rank: int, world: int, custom: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from deepfleet.engine.zero.fsdp_collectives import RingReduceScatter

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
            unit.set_custom_reduce_scatter(RingReduceScatter())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 3, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_training_with_ring_reduce_scatter_equals_default(world_size: int) -> None:
    import torch

    ours = spawn(_train, world_size, True)[0]
    default = spawn(_train, world_size, False)[0]
    assert ours.keys() == default.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], default[name], rtol=1e-6, atol=1e-7, msg=name)
