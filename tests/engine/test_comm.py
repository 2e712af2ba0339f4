"""`deepfleet.engine.comm`: every op runs on real gloo ranks (2 and 3), gives torch's results, and is
counted — counts equal to what torch's `CommDebugMode` sees at the c10d level, bytes equal to the input
payload, seconds positive; async ops hand back a Work whose wait is timed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import deepfleet.engine.comm as comm
from tests.spawn import spawn

# Each tensor op is one c10d op (the *_object calls add allgather_/broadcast_ ops; barrier is none).
C10D_NAME = {
    "all_reduce": "allreduce_",
    "broadcast": "broadcast_",
    "all_gather": "allgather_",
    "all_gather_into_tensor": "_allgather_base_",
    "reduce_scatter_tensor": "_reduce_scatter_base_",
    "all_to_all_single": "alltoall_base_",
    "reduce": "reduce_",
    "gather": "gather_",
    "scatter": "scatter_",
}


@pytest.fixture(autouse=True)
def no_default_group():
    """These tests start from no default process group in this process (whatever ran before here)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield


def _every_op(rank: int, world: int) -> dict:
    """Run each op once on distinct data; return results, our counters and CommDebugMode's."""
    from torch.distributed.tensor.debug import CommDebugMode

    comm.reset_counters()
    n = 6
    x = torch.arange(n, dtype=torch.float32) + 10 * rank  # (n,)
    out: dict = {}
    with CommDebugMode() as mode:
        t = x.clone()
        comm.all_reduce(t)
        out["all_reduce"] = t
        t = x.clone()
        comm.all_reduce(t, op=comm.ReduceOp.MAX)
        out["all_reduce_max"] = t
        t = x.clone()
        comm.broadcast(t, src=world - 1)
        out["broadcast"] = t
        parts = [torch.empty(n) for _ in range(world)]
        comm.all_gather(parts, x)
        out["all_gather"] = torch.cat(parts)
        gathered = torch.empty(world * n)
        comm.all_gather_into_tensor(gathered, x)
        out["all_gather_into_tensor"] = gathered
        shard = torch.empty(n)
        comm.reduce_scatter_tensor(shard, torch.arange(world * n, dtype=torch.float32) * (rank + 1))
        out["reduce_scatter_tensor"] = shard
        a2a = torch.empty(world * 2)
        comm.all_to_all_single(a2a, torch.full((world * 2,), float(rank)))
        out["all_to_all_single"] = a2a
        t = x.clone()
        comm.reduce(t, dst=0)
        out["reduce"] = t if rank == 0 else None
        glist = [torch.empty(n) for _ in range(world)] if rank == 0 else None
        comm.gather(x, gather_list=glist, dst=0)
        out["gather"] = torch.cat(glist) if rank == 0 else None
        recv = torch.empty(n)
        comm.scatter(recv, scatter_list=[torch.full((n,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
        out["scatter"] = recv
        work = comm.all_reduce(x.clone(), async_op=True)
        out["async_is_work"] = isinstance(work, dist.Work)
        out["async_wait"] = work.wait()
        objs = [None] * world
        comm.all_gather_object(objs, {"rank": rank})
        out["all_gather_object"] = objs
        box = [f"from {rank}"]
        comm.broadcast_object_list(box, src=0)
        out["broadcast_object_list"] = box[0]
        comm.barrier()
    # Point to point between ranks 0 and 1 (outside the debug mode, which counts only collectives).
    if rank < 2:
        peer = 1 - rank
        buf = torch.full((3,), float(rank))
        if rank == 0:
            comm.send(buf, dst=peer)
            comm.irecv(buf, src=peer).wait()
        else:
            comm.recv(buf, src=peer)
            comm.isend(buf + 1, dst=peer).wait()
        out["p2p"] = buf
    debug = {str(op).split(".")[-1].split("'")[0]: c for op, c in mode.get_comm_counts().items()}
    return {"out": out, "ours": comm.counters(), "debug": debug}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_op_gives_torch_results_and_is_counted(world):
    results = spawn(_every_op, world)
    n = 6
    xs = [torch.arange(n, dtype=torch.float32) + 10 * r for r in range(world)]
    for rank, res in enumerate(results):
        out, ours, debug = res["out"], res["ours"], res["debug"]
        torch.testing.assert_close(out["all_reduce"], sum(xs))
        torch.testing.assert_close(out["all_reduce_max"], xs[-1])
        torch.testing.assert_close(out["broadcast"], xs[-1])
        torch.testing.assert_close(out["all_gather"], torch.cat(xs))
        torch.testing.assert_close(out["all_gather_into_tensor"], torch.cat(xs))
        full = torch.arange(world * n, dtype=torch.float32) * sum(r + 1 for r in range(world))
        torch.testing.assert_close(out["reduce_scatter_tensor"], full[rank * n:(rank + 1) * n])
        torch.testing.assert_close(out["all_to_all_single"], torch.arange(world).float().repeat_interleave(2))
        if rank == 0:
            torch.testing.assert_close(out["reduce"], sum(xs))
            torch.testing.assert_close(out["gather"], torch.cat(xs))
        torch.testing.assert_close(out["scatter"], torch.full((n,), float(rank)))
        assert out["async_is_work"] and out["async_wait"]
        assert out["all_gather_object"] == [{"rank": r} for r in range(world)]
        assert out["broadcast_object_list"] == "from 0"
        if rank < 2:
            # rank 1 receives rank 0's zeros and sends them back plus one
            torch.testing.assert_close(out["p2p"], torch.full((3,), 1.0 - rank))

        # Counts: one c10d op per tensor op, as CommDebugMode sees them.
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                     "reduce", "gather", "scatter"):
            assert ours[name].count == debug[C10D_NAME[name]], name
        assert ours["all_reduce"].count == 3
        # The object calls ride on extra allgather_/broadcast_ ops of their own (sizes, then payload).
        assert ours["all_gather"].count == 1 and debug["allgather_"] == 1 + 2
        assert ours["broadcast"].count == 1 and debug["broadcast_"] == 1 + 2
        assert ours["barrier"].count == 1 and ours["all_gather_object"].count == 1

        # Bytes: this rank's input payload.
        f32 = 4
        assert ours["all_reduce"].bytes == 3 * n * f32
        assert ours["broadcast"].bytes == n * f32
        assert ours["all_gather"].bytes == ours["all_gather_into_tensor"].bytes == n * f32
        assert ours["reduce_scatter_tensor"].bytes == world * n * f32
        assert ours["all_to_all_single"].bytes == world * 2 * f32
        assert ours["scatter"].bytes == (world * n * f32 if rank == 0 else 0)
        assert ours["barrier"].bytes == ours["all_gather_object"].bytes == 0
        if rank == 0:
            assert ours["send"].bytes == 3 * f32 and ours["irecv"].bytes == 0
        elif rank == 1:
            assert ours["recv"].bytes == 0 and ours["isend"].bytes == 3 * f32
        assert all(c.seconds > 0 for c in ours.values())


def test_without_a_process_group_ranks_are_trivial_and_reset_clears():
    assert not dist.is_initialized()
    assert (comm.get_rank(), comm.get_world_size()) == (0, 1)
    comm.reset_counters()
    assert comm.counters() == {}


def test_log_name_files_the_op_under_it():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm.reset_counters()
        comm.all_reduce(torch.ones(2), log_name="grad_norm")
        snapshot = comm.counters()
        comm.all_reduce(torch.ones(2), log_name="grad_norm")
        assert snapshot["grad_norm"].count == 1 and comm.counters()["grad_norm"].count == 2
        assert "all_reduce" not in snapshot
    finally:
        dist.destroy_process_group()


def test_deepspeed_scripts_reach_comm_as_an_attribute():
    import deepfleet.engine as deepspeed

    assert deepspeed.comm is comm
