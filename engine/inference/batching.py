"""Continuous batching: requests join between decode steps and leave when they finish.

Called by `engine.InferenceEngine` (`generate`, `submit`/`step`, and the HTTP server's loop). Each
`step()` first prefills the waiting requests that fit in free cache slots (one batched forward over
their prompts, right-padded; each row's first token comes from its own last prompt position), then
runs one decode step over every request that was already running (one token each, at each row's own
position). A request leaves the batch when it emits an end-of-sequence token, reaches its
`max_new_tokens`, or fills its slot (`max_out_tokens`), and its slot goes to the next waiting request.
Rows never wait for each other: there is no padding inside the cache, only per-row positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from deepfleet.engine.inference.attention import Packed
from deepfleet.engine.inference.cache import KVCache
from deepfleet.engine.inference.decoder import Decoder
from deepfleet.engine.inference.sampling import Sampling, next_token

_ids = itertools.count()


@dataclass
class Request:
    """One sequence to continue; `tokens` grows as it is generated, `finish_reason` is set at the end
    ("stop": an end-of-sequence token, "length": max_new_tokens or the cache slot is full)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    slot: int | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Batcher:
    """Owns the running batch over one decoder and its cache."""

    def __init__(self, decoder: Decoder, cache: KVCache) -> None:
        self.decoder, self.cache = decoder, cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # The compiled steps (`compiled.py`) when installed: (tokens, positions, slots, last_position=) and
        # (tokens, positions, packed) -> (logits, greedy tokens).
        self.decode_step: Any = None
        self.prefill_step: Any = None

    def submit(self, request: Request) -> Request:
        """Queue a request; it joins the batch at the next step with a free slot. ValueError when its
        prompt plus max_new_tokens cannot fit in one cache slot, or the prompt is empty."""
        if not request.prompt:
            raise ValueError("prompt: must hold at least one token")
        limit = min(self.cache.max_tokens, self.decoder.spec.max_positions)
        if len(request.prompt) + request.max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens: prompt of {len(request.prompt)} tokens + {request.max_new_tokens} new tokens "
                f"exceeds the {limit} positions a sequence may use (max_out_tokens / the model's positions); "
                "shorten the request or raise max_out_tokens")
        self.waiting.append(request)
        return request

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, int]]:
        """Advance every request by one token; returns the (request, token) pairs made this step."""
        made: list[tuple[Request, int]] = []
        running = list(self.running)
        if running:
            made += self._decode(running)
        admitted = []
        while self.waiting and self.cache.free:
            request = self.waiting.pop(0)
            request.slot = self.cache.take()
            admitted.append(request)
        if admitted:
            made += self._prefill(admitted)
        self.running = [r for r in running + admitted if not r.done]
        return made

    def _device(self) -> torch.device:
        return self.cache.layers[0][0].device

    def _prefill(self, requests: list[Request]) -> list[tuple[Request, int]]:
        # The prompts end to end, (1, tokens): no padding through the projections and the MLP.
        device = self._device()
        packed = Packed.of([len(r.prompt) for r in requests], [r.slot for r in requests], device=device)
        tokens = torch.tensor([[t for r in requests for t in r.prompt]], dtype=torch.long, device=device)
        positions = torch.tensor([[p for r in requests for p in range(len(r.prompt))]], device=device)
        if self.prefill_step is not None:
            return self._emit(requests, *self.prefill_step(tokens, positions, packed))
        logits = self.decoder(tokens, positions, cache=self.cache.layers, packed=packed)
        return self._emit(requests, logits[:, -1])

    def _decode(self, requests: list[Request]) -> list[tuple[Request, int]]:
        device = self._device()
        at = [len(r.prompt) + len(r.tokens) - 1 for r in requests]  # each row's position
        tokens = torch.tensor([[r.tokens[-1]] for r in requests], device=device)
        positions = torch.tensor([[p] for p in at], device=device)
        if self.decode_step is not None:
            logits, greedy = self.decode_step(tokens, positions, [r.slot for r in requests], last_position=max(at))
            return self._emit(requests, logits, greedy)
        slots = torch.tensor([r.slot for r in requests], device=device)
        logits = self.decoder(tokens, positions, cache=self.cache.layers, slots=slots)
        return self._emit(requests, logits[:, -1])

    def _emit(self, requests: list[Request], logits: torch.Tensor,
              greedy: torch.Tensor | None = None) -> list[tuple[Request, int]]:
        """`greedy` (batch,): the greedy tokens when the step computed them already."""
        made = []
        if greedy is None:
            # max(-1).indices in fp32: the same first index of the maximum as argmax (both documented
            # so), ~5x faster on CPU than argmax, and bf16/fp16 -> fp32 is exact
            greedy = logits.float().max(-1).indices
        greedy = greedy.tolist()
        for i, r in enumerate(requests):
            token = greedy[i] if not r.sampling.do_sample else next_token(logits[i], r.sampling, r.generator)
            r.tokens.append(token)
            made.append((r, token))
            if token in r.eos_token_ids:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.cache.max_tokens:
                r.finish_reason = "length"
            if r.done:
                self.cache.give_back(r.slot)
        return made

    def cancel(self, request: Request) -> None:
        """Drop a request (a client went away); its slot is freed at once."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self.cache.give_back(request.slot)
        request.finish_reason = request.finish_reason or "cancelled"
