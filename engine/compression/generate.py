"""Greedy decoding for a causal LM given as `model(ids) -> logits`, without a KV cache.

The plain baseline that a compressed and cleaned model (`redundancy_clean`) runs before an inference
engine loads it; used by the compression benchmark and tests. Each step re-runs the whole window
(the last `max_context` tokens), so it is O(n^2) and meant for short generations only.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_generate(model: nn.Module, ids: torch.Tensor, *, max_new_tokens: int, max_context: int) -> torch.Tensor:
    """Append `max_new_tokens` argmax tokens to `ids` (batch, seq); returns (batch, seq + new)."""
    was_training = model.training
    model.eval()
    out = ids
    for _ in range(max_new_tokens):
        logits = model(out[:, -max_context:])  # (batch, window, vocab)
        out = torch.cat([out, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    model.train(was_training)
    return out
