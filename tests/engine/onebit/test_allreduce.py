"""The 1-bit compressed all-reduce (`engine/onebit/allreduce.py`) on 2 and 3 gloo ranks: the result equals
the two-phase formula computed here from every rank's input (signs, per-chunk mean-|c| scales), what
compression dropped is exactly what the worker and server errors hold, the errors carry into the next
call, and the bytes counted by `engine/comm.py` are the packed bits and scales."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

N, CHUNK = 96, 8  # a multiple of 2 * 8 and of 3 * 8


def _inputs(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(N, generator=g) * (r + 1) for r in range(world)]


def _compress(c: torch.Tensor, chunk: int) -> torch.Tensor:
    """sign(c) (>= 0 is +) times each chunk's mean |c| — the formula, written independently of the kernel."""
    scales = c.abs().view(-1, chunk).mean(1).repeat_interleave(chunk)
    return torch.where(c >= 0, scales, -scales)


def _run(rank: int, world: int) -> dict:
    import deepfleet.engine.comm as comm
    from deepfleet.engine.onebit.allreduce import compressed_all_reduce

    x = _inputs(world)[rank]
    worker = torch.zeros(N)
    server = torch.zeros(N // world)
    comm.reset_counters()
    first = compressed_all_reduce(x.clone(), worker, server, chunk=CHUNK)
    counted = {k: v.bytes for k, v in comm.counters().items()}
    after_first = (worker.clone(), server.clone())
    second = compressed_all_reduce(x.clone(), worker, server, chunk=CHUNK)
    return {"first": first, "second": second, "errors": after_first, "bytes": counted}


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_all_reduce_equals_the_formula(world: int) -> None:
    out = spawn(_run, world)
    xs = _inputs(world)
    seg = N // world
    # phase 1 on every rank, phase 2 on every segment's server
    worker_q = [_compress(x, CHUNK) for x in xs]
    mean = torch.stack(worker_q).mean(0)
    expected = torch.cat([_compress(mean[s * seg:(s + 1) * seg], CHUNK) for s in range(world)])
    for r in range(world):
        torch.testing.assert_close(out[r]["first"], expected, rtol=0, atol=1e-6)
        assert torch.equal(out[r]["first"], out[0]["first"])  # replicated
        torch.testing.assert_close(out[r]["errors"][0], xs[r] - worker_q[r], rtol=0, atol=1e-6)
    # what compression dropped sits in the errors: result + mean(worker errors) + server errors = mean(x)
    server = torch.cat([out[s]["errors"][1] for s in range(world)])
    worker_mean = torch.stack([out[r]["errors"][0] for r in range(world)]).mean(0)
    torch.testing.assert_close(out[0]["first"] + worker_mean + server, torch.stack(xs).mean(0), rtol=0, atol=1e-5)
    # the second call starts from those errors
    worker2 = [_compress(xs[r] + out[r]["errors"][0], CHUNK) for r in range(world)]
    mean2 = torch.stack(worker2).mean(0) + server
    expected2 = torch.cat([_compress(mean2[s * seg:(s + 1) * seg], CHUNK) for s in range(world)])
    torch.testing.assert_close(out[0]["second"], expected2, rtol=0, atol=1e-5)
    # bytes out of each rank: N/8 bits + N/CHUNK fp32 scales, then this rank's segment of both
    assert out[0]["bytes"] == {
        "onebit_all_to_all": N // 8 + 4 * N // CHUNK,
        "onebit_all_gather": (N // 8 + 4 * N // CHUNK) // world,
    }


def test_shapes_that_do_not_fit_are_refused() -> None:
    from deepfleet.engine.onebit.allreduce import chunk_size, compressed_all_reduce, padded_numel

    with pytest.raises(ValueError, match="multiple of 1 \\* 8"):
        compressed_all_reduce(torch.zeros(12), torch.zeros(12), torch.zeros(12), chunk=8)
    assert chunk_size(10, 2) == 8 and chunk_size(10**6, 2) == 2048
    assert padded_numel(4097, 2, 2048) == 8192
