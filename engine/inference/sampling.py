"""Next-token choice from logits: greedy, or sampling with temperature, top-k and top-p.

Called by `batching.Batcher` once per request per step. The order and meaning follow Hugging Face's
`generate` (temperature, then top-k, then top-p, then a multinomial draw; `top_k=0` and `top_p=1.0`
turn those filters off), so a request means the same thing here as there. Each request may carry its
own `torch.Generator`, which makes a sampled sequence reproducible whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How one request picks tokens. ValueError (naming the field) for out-of-range values."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


def next_token(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """The chosen token id for one row of logits (vocab,)."""
    if not sampling.do_sample:
        return int(logits.argmax())
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
