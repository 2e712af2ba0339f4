"""Compression-aware Linear, Conv2d and Embedding layers (what `init_compression` swaps in).

Each layer is a subclass of its torch layer (isinstance checks and FSDP2's per-block wrapping are
unaffected) and keeps the original weight/bias Parameter objects, so optimizers and param groups
built on the model before compression still point at them. The forward applies, in DeepSpeed's
order, weight fake-quantization -> sparse mask -> row mask -> head mask, and fake-quantizes the input
for activation quantization; all gradients are straight-through (`quantizers.py`, `masks.py`).

Which technique is active is a pure function of the engine step the scheduler last handed over with
`set_step` (`scheduler.py`). State that is not a function of the step (L1 masks fixed when pruning
began, the static activation range) lives in non-persistent buffers that the scheduler's state dict
carries through checkpoints; learned top-k scores are ordinary parameters, saved with the model.
Masks are computed inside the forward, where ZeRO-3 has gathered the full weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine.compression import masks as M
from deepfleet.engine.compression.quantizers import (
    fake_quantize,
    last_switch,
    scheduled_bits,
    token_groups,
)

ACT_RANGE_MOMENTUM = 0.95  # DeepSpeed's default for static activation-range calibration


class CompressedMixin:
    """What the three layer types share: technique settings, the step, buffers, weight transform."""

    weight: nn.Parameter

    def _init_compression(self) -> None:
        self.techniques: dict[str, dict[str, Any]] = {}  # DeepSpeed technique name -> settings
        self.step = 0

    def set_step(self, step: int) -> None:
        """The engine step the schedules are evaluated at (called by the scheduler)."""
        self.step = int(step)

    def active(self, technique: str) -> bool:
        t = self.techniques.get(technique)
        return t is not None and self.step >= t["schedule_offset"]

    def compression_buffers(self) -> dict[str, torch.Tensor]:
        """The non-persistent state to checkpoint (masks fixed at a step, activation range)."""
        return {name: buf for name, buf in self.named_buffers(recurse=False) if name.startswith("cq_")}  # type: ignore[attr-defined]

    # --- configuration (from init_compression) ---------------------------------------------------

    def enable(self, technique: str, settings: dict[str, Any]) -> None:
        """Attach one technique with its merged shared + group settings."""
        self.techniques[technique] = settings
        w = self.weight
        method = settings.get("method")
        if technique == "sparse_pruning":
            self.register_buffer("cq_sparse_mask", torch.ones_like(w, device=w.device), persistent=False)
            # The ratio the mask was computed at, in parts per million: an integer, so casting the model
            # to 16 bits cannot round it and trigger a recomputation at every forward.
            self.register_buffer("cq_sparse_ppm", torch.tensor(-1, device=w.device), persistent=False)
            if method == "topk":
                self.sparse_mask_scores = nn.Parameter(_kaiming_like(w))
        elif technique in ("row_pruning", "channel_pruning"):
            shape = (w.shape[0], *([1] * (w.dim() - 1)))
            self.register_buffer("cq_row_mask", torch.ones(shape, device=w.device), persistent=False)
            self.register_buffer("cq_row_ready", torch.tensor(False, device=w.device), persistent=False)
            if method == "topk":
                self.row_mask_scores = nn.Parameter(_kaiming_like(torch.empty(shape, device=w.device)))
        elif technique == "head_pruning":
            heads = settings["num_heads"]
            if w.shape[1] % heads:
                raise ValueError(f"head_pruning.num_heads: {heads} does not divide the {w.shape[1]} inputs of this layer")
            self.register_buffer("cq_head_mask", torch.ones(1, heads, device=w.device), persistent=False)
            self.register_buffer("cq_head_ready", torch.tensor(False, device=w.device), persistent=False)
            if method == "topk":
                self.head_pruning_scores = nn.Parameter(_kaiming_like(torch.empty(1, heads, device=w.device)))
        elif technique == "activation_quantization" and settings["range_calibration"] == "static":
            self.register_buffer("cq_act_range", torch.zeros(2, device=w.device), persistent=False)
        elif technique == "weight_quantization" and w.numel() % settings["quantize_groups"]:
            raise ValueError(
                f"weight_quantization.quantize_groups: {settings['quantize_groups']} does not divide the "
                f"{w.numel()} weights of this layer; use a divisor of its output size"
            )

    # --- the forward transforms --------------------------------------------------------------------

    def current_bits(self) -> int:
        wq = self.techniques["weight_quantization"]
        if wq["quantize_weight_in_forward"]:
            return wq["target_bits"]
        return scheduled_bits(self.step - wq["schedule_offset"], start_bits=wq["start_bits"],
                              target_bits=wq["target_bits"], period=wq["quantization_period"])

    def quantized_weight(self, w: torch.Tensor) -> torch.Tensor:
        wq = self.techniques["weight_quantization"]
        q = fake_quantize(w, self.current_bits(), groups=wq["quantize_groups"],
                          symmetric=wq["quantization_type"] == "symmetric",
                          stochastic=wq["rounding"] == "stochastic" and self.training)  # type: ignore[attr-defined]
        mixed = wq["fp16_mixed_quantize"]
        if mixed["enabled"] and not wq["quantize_weight_in_forward"]:
            since = self.step - wq["schedule_offset"]
            switch = last_switch(since, start_bits=wq["start_bits"], target_bits=wq["target_bits"],
                                 period=wq["quantization_period"])
            real = max(0.0, 1.0 - mixed["quantize_change_ratio"] * (since - switch))
            q = real * w + (1.0 - real) * q
        return q

    def sparse_mask(self) -> torch.Tensor:
        sp = self.techniques["sparse_pruning"]
        nm = sp.get("nm")
        if sp["method"] == "topk":
            scores = self.sparse_mask_scores
            if nm is not None:
                return M.nm_mask(scores, *nm) + (scores - scores.detach())
            ratio = M.ramped_ratio(self.step, dense_ratio=sp["dense_ratio"], offset=sp["schedule_offset"],
                                   end=sp["schedule_offset_end"], stride=sp["schedule_offset_stride"])
            return M.topk_mask(scores, ratio)
        ratio = 0.0 if nm is not None else M.ramped_ratio(
            self.step, dense_ratio=sp["dense_ratio"], offset=sp["schedule_offset"],
            end=sp["schedule_offset_end"], stride=sp["schedule_offset_stride"])
        ppm = round(ratio * 1_000_000)
        if int(self.cq_sparse_ppm) != ppm:  # pruning just began, or the ramp moved on
            with torch.no_grad():
                fresh = M.nm_mask(self.weight, *nm) if nm is not None else M.l1_mask(self.weight, ratio)
                self.cq_sparse_mask.copy_(fresh)
                self.cq_sparse_ppm.fill_(ppm)
        return self.cq_sparse_mask

    def row_mask(self) -> torch.Tensor:
        technique = "row_pruning" if "row_pruning" in self.techniques else "channel_pruning"
        rp = self.techniques[technique]
        if rp["method"] == "topk":
            return M.topk_mask(self.row_mask_scores, rp["dense_ratio"])
        if not bool(self.cq_row_ready):
            with torch.no_grad():
                self.cq_row_mask.copy_(M.topk_mask(M.row_scores_l1(self.weight), rp["dense_ratio"]))
                self.cq_row_ready.fill_(True)
        return self.cq_row_mask

    def head_mask(self) -> torch.Tensor:
        hp = self.techniques["head_pruning"]
        if hp["method"] == "topk":
            return M.topk_mask(self.head_pruning_scores, hp["dense_ratio"])
        if not bool(self.cq_head_ready):
            with torch.no_grad():
                self.cq_head_mask.copy_(M.topk_mask(M.head_scores_l1(self.weight, hp["num_heads"]), hp["dense_ratio"]))
                self.cq_head_ready.fill_(True)
        return self.cq_head_mask

    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward uses at the current step."""
        w, b = self.weight, getattr(self, "bias", None)
        if self.active("weight_quantization"):
            w = self.quantized_weight(w)
        if self.active("sparse_pruning"):
            w = w * self.sparse_mask()
        if self.active("row_pruning") or self.active("channel_pruning"):
            m = self.row_mask()
            w = w * m
            b = b * m.reshape(-1) if b is not None else None
        if self.active("head_pruning"):
            w = w * M.head_columns(self.head_mask(), w.shape[1])
        dormant = [s for t, s in self._scores() if not self.active(t)]
        if dormant:  # scores before their offset join the graph with zero gradient (DDP needs every
            w = w + sum(s.sum() for s in dormant) * 0.0  # parameter used in each backward)
        return w, b

    def _scores(self) -> list[tuple[str, nn.Parameter]]:
        names = {"sparse_pruning": "sparse_mask_scores", "row_pruning": "row_mask_scores",
                 "channel_pruning": "row_mask_scores", "head_pruning": "head_pruning_scores"}
        return [(t, getattr(self, names[t])) for t in self.techniques
                if t in names and hasattr(self, names[t])]

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active("activation_quantization"):
            return x
        aq = self.techniques["activation_quantization"]
        symmetric = aq["quantization_type"] == "symmetric"
        if aq["range_calibration"] == "dynamic":
            return fake_quantize(x, aq["bits"], groups=token_groups(x), symmetric=symmetric)
        r = self.cq_act_range
        if self.training:  # type: ignore[attr-defined]
            with torch.no_grad():
                lo, hi = x.detach().min().to(r.dtype), x.detach().max().to(r.dtype)
                if r[0] == r[1]:  # first batch: start the average at its range
                    r[0], r[1] = lo, hi
                r[0] = r[0] * ACT_RANGE_MOMENTUM + lo * (1 - ACT_RANGE_MOMENTUM)
                r[1] = r[1] * ACT_RANGE_MOMENTUM + hi * (1 - ACT_RANGE_MOMENTUM)
        return fake_quantize(x, aq["bits"], groups=1, symmetric=symmetric, min_max=(r[0], r[1]))


def _kaiming_like(t: torch.Tensor) -> torch.Tensor:
    """Score initialization (DeepSpeed's: Kaiming-uniform with a = sqrt(5), as torch's Linear weights)."""
    scores = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    nn.init.kaiming_uniform_(scores.view(scores.shape[0], -1) if scores.dim() > 1 else scores.view(1, -1), a=5**0.5)
    return scores


class CompressedLinear(CompressedMixin, nn.Linear):
    """nn.Linear with quantization-aware training and pruning masks."""

    @classmethod
    def wrap(cls, old: nn.Linear) -> CompressedLinear:
        new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        new.weight, new.bias = old.weight, old.bias
        new._init_compression()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.compressed_weight()
        return F.linear(self.quantized_input(x), w, b)


class CompressedConv2d(CompressedMixin, nn.Conv2d):
    """nn.Conv2d with quantization-aware training, sparse and channel pruning."""

    @classmethod
    def wrap(cls, old: nn.Conv2d) -> CompressedConv2d:
        new = cls(old.in_channels, old.out_channels, old.kernel_size, stride=old.stride, padding=old.padding,
                  dilation=old.dilation, groups=old.groups, bias=old.bias is not None,
                  padding_mode=old.padding_mode, device="meta")
        new.weight, new.bias = old.weight, old.bias
        new._init_compression()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.compressed_weight()
        return self._conv_forward(self.quantized_input(x), w, b)


class CompressedEmbedding(CompressedMixin, nn.Embedding):
    """nn.Embedding with weight quantization (one group per token, as DeepSpeed does)."""

    @classmethod
    def wrap(cls, old: nn.Embedding) -> CompressedEmbedding:
        new = cls(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx, max_norm=old.max_norm,
                  norm_type=old.norm_type, scale_grad_by_freq=old.scale_grad_by_freq, sparse=old.sparse,
                  device="meta")
        new.weight = old.weight
        new._init_compression()
        return new

    def enable(self, technique: str, settings: dict[str, Any]) -> None:
        if technique != "weight_quantization":
            return  # DeepSpeed quantizes embeddings' weights only; other techniques skip them
        super().enable(technique, {**settings, "quantize_groups": self.num_embeddings})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight(self.weight) if self.active("weight_quantization") else self.weight
        return F.embedding(idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)


WRAPPERS: dict[type[nn.Module], Any] = {
    nn.Linear: CompressedLinear,
    nn.Conv2d: CompressedConv2d,
    nn.Embedding: CompressedEmbedding,
}
