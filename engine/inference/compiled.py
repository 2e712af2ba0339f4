"""The decode step and the prefill under `torch.compile`.

Called by `batching.Batcher` once `InferenceEngine.compile()` (DeepSpeed's engine method name) installed
a `StaticDecodeStep` and a `CompiledPrefill`.

The decode step runs at static shapes, so it compiles once per key bucket and row bucket. Eager decoding
hands the decoder a batch of however many requests run and keys up to the largest position, so every
step has new shapes. Here each step is padded to the same shapes: the rows are the cache rows 0..R-1 in
order (no gather), R the power of two (1, 2, 4, ... up to max_batch_size) above the highest running slot
(slots are handed out lowest first, so R is about the batch), and the rows of idle slots decode a
dummy token at position 0 of their own free slot (which the next prefill overwrites; the result is
dropped). So the graph sees a handful of shapes over an engine's life and compiles once for each
(`dynamic=False`: fixed shapes give inductor's best code, with no guards on sizes), with one exception:
the key count. Keys run to the largest live position + 1, handed in as the size of a tensor marked
dynamic, so one graph takes every length and attention reads only the filled part of the cache (an
earlier version bucketed it to 64, 128, 256, ... positions: it read a third more of the cache on the
benchmark's batch-16 generate, and a long-lived engine of 16 slots and 1024 positions needed 25 graphs,
past torch's limit of 8 recompiles). On CPU it is compiled with inductor's C++ wrapper, which
calls the step's kernels and matmuls without Python in between; its attention is the reduction form of
`attention.decode_attention`, and it returns the greedy tokens with the logits.

The prefill is packed (`attention.Packed`: prompts end to end), so its only varying sizes are the token
count, the prompt count and the widest prompt; it is compiled with `dynamic=True` and measured 2 graphs
over any mix of prompts (one for a single prompt, where torch specializes the size-1 prompt count, one
for several). Before packing, a compiled prefill of right-padded (batch, width) prompts recompiled for
each new shape (15 graphs for a handful).

Where it pays: many small ops per step (small and medium models on CPU, where eager spends much of its
time in per-op dispatch; measured on benchmarks/inference.py's Llama, with `replace_with_kernel_inject`:
see that benchmark's docstring for the figures); inductor fuses the norms, rotary, attention, masks and
residual adds around the matmuls. Where it does not: a batch just above a power of two or with a high
slot left running (the idle rows up to R are computed too), short rows beside a long one (every row
reads keys up to the longest), large models whose step time is matmul-bound anyway, and short-lived
engines, since the first call of each graph compiles (tens of seconds on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deepfleet.engine.inference.attention import Packed
from deepfleet.engine.inference.cache import KVCache
from deepfleet.engine.inference.decoder import Decoder


def row_bucket(rows: int, *, slots: int) -> int:
    """The smallest power of two holding `rows` cache rows, capped at `slots`."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, slots)


class _FullStep(nn.Module):
    """The decoder's step over all slots. The cache comes in as arguments, never as attributes, so a
    compile that freezes the module's weights into constants (inductor's `freezing`) leaves it mutable."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: Tensor, positions: Tensor, keys: Tensor, *cache: Tensor) -> tuple[Tensor, Tensor]:
        # tokens, positions (slots, 1); keys (span,): only its size counts (the keys attention reads);
        # cache: k0, v0, k1, v1, ... -> last logits (slots, vocab) and their greedy tokens (slots,): the
        # argmax fuses into the step instead of costing an eager op after it
        layers = list(zip(cache[0::2], cache[1::2], strict=True))
        logits = self.decoder(tokens, positions, cache=layers, slots=None, span=keys.shape[0])[:, -1]
        return logits, logits.float().argmax(-1)


class StaticDecodeStep:
    """One decode step over every cache slot, compiled; `__call__` takes the running rows only."""

    def __init__(self, decoder: Decoder, cache: KVCache, *, backend: str = "inductor",
                 compile_kwargs: dict[str, Any] | None = None) -> None:
        self.decoder, self.cache = decoder, cache
        decoder.pin_kernels()
        for layer in decoder.layers:  # one-query attention as reductions inductor fuses (attention.py)
            layer.reduce_decode_attention = True
        self._flat = [t for kv in cache.layers for t in kv]
        self._keys = torch.empty(cache.max_tokens, device=cache.layers[0][0].device)  # sliced to the span
        kwargs = dict(compile_kwargs or {})
        if backend == "inductor" and "mode" not in kwargs and cache.layers[0][0].device.type == "cpu":
            # C++ instead of Python for the code around the kernels: it calls the 20-odd kernels and
            # matmuls of a step without Python dispatch (measured 4% of a batch-16 generate)
            kwargs["options"] = {"cpp_wrapper": True, **kwargs.get("options", {})}
        self._step = torch.compile(_FullStep(decoder), backend=backend, dynamic=False, **kwargs)

    def _full_step(self, tokens: Tensor, positions: Tensor, span: int) -> tuple[Tensor, Tensor]:
        keys = self._keys[:span]
        torch._dynamo.mark_dynamic(keys, 0)  # a size >= 2: decode positions start at 1
        return self._step(tokens, positions, keys, *self._flat)

    def __call__(self, tokens: Tensor, positions: Tensor, slots: list[int], *,
                 last_position: int) -> tuple[Tensor, Tensor]:
        """tokens, positions (batch, 1) of the running rows in cache slots `slots`, the largest of the
        positions given as an int (the caller has them as ints: no tensor max, no host sync) -> logits
        (batch, vocab) and the greedy tokens (batch,)."""
        n = row_bucket(max(slots) + 1, slots=self.cache.slots)  # slots go lowest first: usually n ~ batch
        span = last_position + 1
        if len(slots) == n and slots == list(range(n)):  # the rows already are cache rows 0..n-1, in order
            return self._full_step(tokens, positions, span)
        full_tokens = torch.zeros(n, 1, dtype=tokens.dtype, device=tokens.device)
        full_positions = torch.zeros(n, 1, dtype=positions.dtype, device=positions.device)
        index = torch.tensor(slots, device=tokens.device)
        full_tokens[index] = tokens
        full_positions[index] = positions
        logits, greedy = self._full_step(full_tokens, full_positions, span)
        return logits[index], greedy[index]


class _Prefill(nn.Module):
    """A packed prefill, the fields of its `Packed` and the cache given as arguments (graph inputs)."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, token_slots: Tensor, index: Tensor,
                last: Tensor, width: int, *cache: Tensor) -> tuple[Tensor, Tensor]:
        # tokens, positions (1, tokens) -> each prompt's last logits (prompts, vocab), greedy (prompts,)
        layers = list(zip(cache[0::2], cache[1::2], strict=True))
        packed = Packed(slots=slots, token_slots=token_slots, index=index, last=last, width=width)
        logits = self.decoder(tokens, positions, cache=layers, packed=packed)[:, -1]
        return logits, logits.float().argmax(-1)


class CompiledPrefill:
    """The packed prefill under torch.compile with dynamic sizes (see the module docstring)."""

    def __init__(self, decoder: Decoder, cache: KVCache, *, backend: str = "inductor",
                 compile_kwargs: dict[str, Any] | None = None) -> None:
        self._flat = [t for kv in cache.layers for t in kv]
        self._step = torch.compile(_Prefill(decoder), backend=backend, dynamic=True, **(compile_kwargs or {}))

    def __call__(self, tokens: Tensor, positions: Tensor, packed: Packed) -> tuple[Tensor, Tensor]:
        """tokens, positions (1, tokens) laid out as `packed` says -> logits (prompts, vocab), greedy (prompts,)."""
        return self._step(tokens, positions, packed.slots, packed.token_slots, packed.index, packed.last,
                          packed.width, *self._flat)
