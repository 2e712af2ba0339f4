"""The static KV cache: every layer's keys and values preallocated once, one row ("slot") per sequence.

Created by `engine.InferenceEngine` with `max_batch_size` slots of `max_out_tokens` positions (prompt
and generated tokens together, DeepSpeed's meaning of max_out_tokens); `batching.Batcher` hands slots
to requests and takes them back when they finish, so the memory is allocated once for the engine's
life and a finished sequence's slot is reused by the next request without any copying or compaction.
Layer i's tensors are (slots, kv_heads_i, max_tokens, head_dim): kv heads come from the layer's key
projection width, so a tensor-parallel shard holds only its own heads and pruned layers their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.engine.inference.decoder import Decoder


class KVCache:
    """Per-layer (keys, values) buffers and the free-slot list."""

    def __init__(self, decoder: Decoder, *, slots: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.slots, self.max_tokens = slots, max_tokens
        self.layers: list[tuple[Tensor, Tensor]] = []
        for layer in decoder.layers:
            kv_heads = layer.kv_width() // layer.head_dim
            shape = (slots, kv_heads, max_tokens, layer.head_dim)
            self.layers.append((torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device)))
        self._free = list(range(slots))

    def take(self) -> int | None:
        """The lowest free slot (lowest first, so a full batch uses rows 0..n-1: a view, no gather)."""
        if not self._free:
            return None
        self._free.sort()
        return self._free.pop(0)

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
