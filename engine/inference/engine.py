"""`init_inference(model, config=None, **kwargs) -> InferenceEngine`: DeepSpeed-Inference's entry point.

Called by users' scripts (`deepfleet.engine.init_inference`, the path DeepSpeed scripts use), the
HTTP server (`serve.py`) and the benchmarks. The order of what it does, each step needing the one
before: load `checkpoint` into the model (weights by the model's own names) -> cast to `dtype` ->
convert to the static-cache decoder (`architectures.py`) -> shard over the `tp` ranks
(`tensor_parallel.py`; full weights are needed to cut them) -> with replace_with_kernel_inject, fused
kernels and fused q/k/v and gate/up projections (of the shards) -> quantize the linears
(`quantize.py`; each rank quantizes only its shard, fused or not) -> with replace_with_kernel_inject,
the fp32 projections left are stored transposed for the CPU matmul (`decoder.MatmulLinear`) ->
allocate the KV cache (its widths are the sharded ones).

`engine.forward(input_ids, attention_mask=None)` returns what the wrapped model returns (Hugging Face:
an output with `.logits`; the example GPT: the logits tensor); `engine.generate(...)` takes Hugging
Face's `generate` arguments that matter for decoding and returns the same tensor layout (the inputs as
given, then the new tokens, rows that stopped early padded with `pad_token_id`). `submit`/`step`
expose continuous batching directly (the server uses them).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor, nn

from deepfleet.engine.inference.architectures import architecture, to_decoder
from deepfleet.engine.inference.batching import Batcher, Request
from deepfleet.engine.inference.cache import KVCache
from deepfleet.engine.inference.config import InferenceConfig
from deepfleet.engine.inference.sampling import Sampling

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}
_GENERATE_ARGS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                  "pad_token_id", "generator", "use_cache", "num_beams", "num_return_sequences")


def parse_config(config: dict | InferenceConfig | None, kwargs: dict[str, Any]) -> InferenceConfig:
    """The config from a dict and keyword arguments (keywords win); ValueError, one line per problem."""
    if isinstance(config, InferenceConfig):
        config = config.model_dump(exclude_unset=True)
    merged = {**(config or {}), **kwargs}
    try:
        return InferenceConfig.model_validate(merged)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "is not an init_inference setting; remove it (see deepfleet.engine.inference.config)"
            lines.append(f"{where}: {msg}")
        raise ValueError("\n".join(lines)) from None


class InferenceEngine(nn.Module):
    """The model prepared for inference (see the module docstring). `module` is the decoder that runs."""

    def __init__(self, model: nn.Module, config: InferenceConfig) -> None:
        super().__init__()
        self.config = config
        self.arch = architecture(model)
        self._hf = self.arch != "example-gpt"
        self._generation_config = getattr(model, "generation_config", None)
        if config.checkpoint is not None:
            from deepfleet.engine.inference.loading import load_weights

            load_weights(model, config.checkpoint)
        self.dtype = TORCH_DTYPES[config.dtype]
        model = model.to(self.dtype)
        decoder = to_decoder(model)
        self.tp_group = None
        if config.tp_size > 1:
            from deepfleet.engine.inference.tensor_parallel import shard_decoder

            self.tp_group = shard_decoder(decoder, tp_size=config.tp_size, group=config.tensor_parallel.tp_group)
        decoder.use_fused_kernels(config.replace_with_kernel_inject)
        if config.weight_bits is not None:
            from deepfleet.engine.inference.quantize import quantize_decoder

            group_size = config.quant.weight.group_size if config.quant is not None else 64
            quantize_decoder(decoder, bits=config.weight_bits, group_size=group_size)
        # After quantization, which takes the nn.Linear layers it quantizes; the fp32 ones left get
        # the transposed layout the CPU matmul reads fastest.
        decoder.use_matmul_layout(config.replace_with_kernel_inject)
        self.module = decoder.eval()
        self.cache = KVCache(decoder, slots=config.max_batch_size, max_tokens=config.max_out_tokens, dtype=self.dtype)
        self.batcher = Batcher(decoder, self.cache)

    # -- compile ---------------------------------------------------------------------------------

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None) -> None:
        """DeepSpeed's `engine.compile(backend, compile_kwargs)`: run every decode step through
        `torch.compile` at static shapes and every prefill at dynamic ones (`compiled.py` says where it
        pays). Greedy tokens stay those of the eager steps; the first step of each row bucket compiles."""
        from deepfleet.engine.inference.compiled import CompiledPrefill, StaticDecodeStep

        self.batcher.decode_step = StaticDecodeStep(self.module, self.cache, backend=backend,
                                                    compile_kwargs=compile_kwargs)
        self.batcher.prefill_step = CompiledPrefill(self.module, self.cache, backend=backend,
                                                    compile_kwargs=compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        return self.batcher.decode_step is not None

    # -- forward ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                **kwargs: Any) -> Any:
        """Logits for every position, as the wrapped model computes them (no cache is touched). Positions
        as the wrapped model's forward takes them: `position_ids`, else OPT counts them from the mask and
        the others number the columns."""
        unknown = sorted(set(kwargs) - {"use_cache", "return_dict"})
        if unknown:
            raise TypeError(f"forward: argument {unknown[0]!r} is not supported (input_ids, attention_mask, "
                            "position_ids)")
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        key_mask = None if attention_mask is None else attention_mask.bool()
        if position_ids is not None:
            positions = position_ids
        elif attention_mask is not None and self.arch == "opt":
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.module(input_ids, positions, key_mask=key_mask)
        if not self._hf:
            return logits
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=logits)

    # -- continuous batching ---------------------------------------------------------------------

    def submit(self, prompt: list[int], *, max_new_tokens: int, sampling: Sampling | None = None,
               eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None) -> Request:
        """Queue one request; it joins the running batch at the next `step()`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        vocab = self.module.spec.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        eos = frozenset([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        return self.batcher.submit(Request(prompt=[int(t) for t in prompt], max_new_tokens=max_new_tokens,
                                           sampling=sampling or Sampling(), eos_token_ids=eos, generator=generator))

    def step(self) -> list[tuple[Request, int]]:
        """One decode step for the running batch (admitting waiting requests first)."""
        return self.batcher.step()

    # -- generate --------------------------------------------------------------------------------

    def _default(self, name: str, value: Any, fallback: Any) -> Any:
        if value is not None:
            return value
        found = getattr(self._generation_config, name, None)
        return found if found is not None else fallback

    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """Hugging Face `generate`'s tensor result for (batch, seq) prompts, left- or right-padded
        through `attention_mask`. Decoding arguments: max_new_tokens / max_length, do_sample,
        temperature, top_k, top_p, eos_token_id, pad_token_id, generator (deepfleet's: a
        torch.Generator for sampling). Beam search and several sequences per prompt are refused."""
        unknown = sorted(set(kwargs) - set(_GENERATE_ARGS))
        if unknown:
            raise TypeError(f"generate: argument {unknown[0]!r} is not supported; supported: {', '.join(_GENERATE_ARGS)}")
        for name in ("num_beams", "num_return_sequences"):
            if kwargs.get(name, 1) != 1:
                raise ValueError(f"{name}: only 1 is supported (greedy or sampled decoding, one sequence per prompt)")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        max_new = kwargs.get("max_new_tokens") or self._default("max_new_tokens", None, None)
        if max_new is None:
            max_new = self._default("max_length", kwargs.get("max_length"), 20) - input_ids.shape[1]
        sampling = Sampling(do_sample=bool(self._default("do_sample", kwargs.get("do_sample"), False)),
                            temperature=float(self._default("temperature", kwargs.get("temperature"), 1.0)),
                            top_k=int(self._default("top_k", kwargs.get("top_k"), 50)),
                            top_p=float(self._default("top_p", kwargs.get("top_p"), 1.0)))
        eos = self._default("eos_token_id", kwargs.get("eos_token_id"), None)
        pad = self._default("pad_token_id", kwargs.get("pad_token_id"), None)
        pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos or [0])[0])
        requests = [self.submit(row[m].tolist(), max_new_tokens=max_new, sampling=sampling, eos_token_id=eos,
                                generator=kwargs.get("generator")) for row, m in zip(input_ids, mask, strict=True)]
        while not all(r.done for r in requests):
            self.step()
        longest = max(len(r.tokens) for r in requests)
        new = torch.full((len(requests), longest), int(pad), dtype=input_ids.dtype)
        for i, r in enumerate(requests):
            new[i, :len(r.tokens)] = torch.tensor(r.tokens, dtype=input_ids.dtype)
        return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def init_inference(model: nn.Module, config: dict | InferenceConfig | None = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's `deepspeed.init_inference`: wrap `model` for generation (see the module docstring).
    ValueError, naming the setting, for a bad config or an unsupported architecture."""
    return InferenceEngine(model, parse_config(config, kwargs))
