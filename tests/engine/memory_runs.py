"""The multi-rank run behind the peak-memory tests in `test_memory.py`: the tiny GPT of `zero_runs.py`
trained through `deepfleet.engine.initialize` (fp32 AdamW) at every ZeRO stage, with gradient
accumulation 1 and 4, recording the engine's model-state high-water mark (`engine/memory.py`'s
`HighWater`: sampled after every forward, every backward, the optimizer step and each micro-step
boundary, and inside stages 1/2 while a reduce bucket's flat buffer is alive).

One spawn per world size runs every (stage, accumulation) pair inside the ranks; cached per session.
"""

from __future__ import annotations

import functools

from tests.engine.zero_runs import MICRO, adamw, make_model
from tests.spawn import spawn

STEPS = 2  # the second step runs with optimizer state allocated from the first
ACCUMULATION = (1, 4)
BUCKET_FRACTION = 16  # reduce_bucket_size = P / 16: the transient flat buffer is 4P/16 bytes


def _batch(step: int, micro: int, rank: int):
    import torch

    from examples.gpt.model import SyntheticTokens
    from tests.engine.zero_runs import MODEL

    data = SyntheticTokens(num_samples=MICRO, seq_len=MODEL.seq_len, vocab_size=MODEL.vocab_size,
                           seed=100 + 31 * step + 7 * micro + rank)
    rows = [data[i] for i in range(MICRO)]
    return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}


def _peaks(rank: int, world_size: int, stage: int, gas: int) -> dict:
    import deepfleet.engine as deepfleet

    model = make_model()
    params = sum(p.numel() for p in model.parameters())
    bucket = params // BUCKET_FRACTION
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      optimizer=adamw)
    peaks = []
    for step in range(STEPS):
        for micro in range(gas):
            engine.backward(engine(_batch(step, micro, rank)))
            engine.step()
        peak, report, point = engine.memory.last
        assert peak == engine.peak_model_state_bytes
        peaks.append({"bytes": peak, "report": report, "point": point})
    return {"params": params, "peaks": peaks}


def _all(rank: int, world_size: int) -> dict:
    return {(stage, gas): _peaks(rank, world_size, stage, gas) for stage in range(4) for gas in ACCUMULATION}


@functools.cache
def memory_runs(world_size: int = 2) -> list[dict]:
    """Per-rank {(stage, gas): {"params", "peaks": [{"bytes"}, ...]}}, computed once per session."""
    return spawn(_all, world_size, timeout=600)
