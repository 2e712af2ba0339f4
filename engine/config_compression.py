"""The `compression_training` config section: DeepSpeed Compression's keys, defaults and meanings.

Read by `deepfleet.engine.config` (the section is a field of the engine config, so a DeepSpeed config
with a `compression_training` block parses unchanged) and by `engine/compression/compress.py`
(`init_compression` / `redundancy_clean`, which also accept the raw DeepSpeed dict or path). Torch-free.
It lives beside config.py, not inside engine/compression/, for the reason config_zero.py does: the
controller validates engine configs and may import only `engine.config*` (import contracts in pyproject).

Every technique has DeepSpeed's two parts: `shared_parameters` (switch, method, schedule) and
`different_groups` (named groups, each with its own `params`, the `modules` it applies to as regular
expressions searched in module names, and for row/head/channel pruning the optional `related_modules`
whose input dimension shrinks with it). Layer reduction is one flat block.

Differences from DeepSpeed, each refused by name rather than ignored: `sparse_pruning.method:
snip_momentum` needs Intel Neural Compressor, which we do not use; weight bits below 3 (DeepSpeed's
ternary and binary quantizers) are not implemented. `sparse_pruning.block_pattern`, which DeepSpeed
reads only for snip_momentum, here selects an N:M structured pattern ("2:4": two kept in every four
consecutive input weights), and `schedule_offset_end`/`schedule_offset_stride` ramp the dense ratio
down linearly from 1 to `dense_ratio` over that window, recomputing the mask every stride steps.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int

Symmetry = Literal["symmetric", "asymmetric"]
PruneMethod = Literal["l1", "topk"]


def _module_patterns(value: Any) -> Any:
    """`modules`: a list of regular expressions (DeepSpeed also accepts one string); "*" matches all."""
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"expected a list of module-name patterns, got {value!r}; write e.g. [\"attention\"]")
    for p in patterns:
        if p != "*":
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"{p!r} is not a regular expression ({e}); fix the pattern") from None
    return patterns


class _Group(ConfigSection):
    modules: list[str] = Field(default_factory=lambda: ["*"])
    """Regular expressions searched in module names (re.search); a module joins the first group that
    names it. "*" matches every compressible module."""
    related_modules: list[list[str]] | None = None
    """For row/head/channel pruning: per entry of `modules`, the patterns of the layers whose input
    dimension follows the pruned output dimension (e.g. the next linear); they shrink with it at
    `redundancy_clean`. Unset: pruned rows are only zeroed."""

    _check_modules = field_validator("modules", mode="before")(_module_patterns)

    @model_validator(mode="after")
    def _related_match(self) -> _Group:
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ValueError(
                f"related_modules: {len(self.related_modules)} entries for {len(self.modules)} modules; "
                "give one list of related patterns per entry of modules"
            )
        return self


class _Technique(ConfigSection):
    @model_validator(mode="after")
    def _groups_when_enabled(self) -> _Technique:
        if self.shared_parameters.enabled and not self.different_groups:  # type: ignore[attr-defined]
            raise ValueError("different_groups: required when shared_parameters.enabled is true; add a group")
        return self


# --------------------------------------------------------------------------- weight quantization


class FP16MixedQuantize(ConfigSection):
    """`fp16_mixed_quantize`: blend full-precision and quantized weights while the bits settle."""

    enabled: Bool = False
    """Use w * r + q(w) * (1 - r), r falling by `quantize_change_ratio` per step from 1 after a bits switch."""
    quantize_change_ratio: Float = Field(0.001, ge=0.0, le=1.0)
    """How much the full-precision share r drops per step."""


class WeightQuantShared(ConfigSection):
    enabled: Bool = False
    """Quantize the weights of the grouped modules."""
    quantizer_kernel: Bool = False
    """DeepSpeed's CUDA quantizer kernel; the pure-torch quantizer computes the same values."""
    schedule_offset: Int = Field(0, ge=0)
    """Engine step from which weights are quantized."""
    quantize_groups: Int = Field(1, ge=1)
    """Number of groups (contiguous slices of the flattened weight) with their own scale."""
    quantize_verbose: Bool = False
    """Log every bits switch."""
    quantization_type: Symmetry = "symmetric"
    """symmetric: scale only, zero at 0; asymmetric: scale and zero point from min/max."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """nearest: round to nearest; stochastic: add uniform noise in [-0.5, 0.5) before rounding (training only)."""
    quantize_weight_in_forward: Bool = False
    """True: quantize at target_bits from the offset on. False: DeepSpeed's MoQ schedule, start_bits
    dropping by one bit whenever the steps since the offset reach the period, which then doubles."""
    fp16_mixed_quantize: FP16MixedQuantize = Field(default_factory=FP16MixedQuantize)
    """Blend full-precision and quantized weights after each bits switch."""
    quantize_change_ratio: Float | None = Field(None, exclude=True)
    """The flat spelling of fp16_mixed_quantize.quantize_change_ratio that some configs use (moved there)."""

    @model_validator(mode="before")
    @classmethod
    def _flat_mixed(cls, data: Any) -> Any:
        """Configs in the wild write `"fp16_mixed_quantize": false` with `quantize_change_ratio` beside
        it; read that as the nested form."""
        if isinstance(data, dict) and (isinstance(data.get("fp16_mixed_quantize"), bool)
                                       or "quantize_change_ratio" in data):
            data = dict(data)
            mixed = data.pop("fp16_mixed_quantize", {})
            mixed = {"enabled": mixed} if isinstance(mixed, bool) else dict(mixed)
            if "quantize_change_ratio" in data:
                mixed.setdefault("quantize_change_ratio", data.pop("quantize_change_ratio"))
            data["fp16_mixed_quantize"] = mixed
        return data


class WeightQuantParams(ConfigSection):
    start_bits: Int = Field(ge=3, le=16)
    """Bits at the schedule offset."""
    target_bits: Int = Field(ge=3, le=16)
    """Bits the schedule ends at (<= start_bits)."""
    quantization_period: Int = Field(1, ge=0)
    """Steps before the first one-bit drop; doubles after each drop (0: straight to target_bits)."""

    @model_validator(mode="after")
    def _order(self) -> WeightQuantParams:
        if self.target_bits > self.start_bits:
            raise ValueError(
                f"target_bits: {self.target_bits} > start_bits {self.start_bits}; bits only go down, "
                "set target_bits <= start_bits"
            )
        return self


class WeightQuantGroup(_Group):
    params: WeightQuantParams
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class WeightQuantization(_Technique):
    """`weight_quantization`: quantization-aware training of weights (fake quantization, STE)."""

    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""


# --------------------------------------------------------------------------- activation quantization


class ActivationQuantShared(ConfigSection):
    enabled: Bool = False
    """Quantize the inputs of the grouped modules."""
    quantization_type: Symmetry = "symmetric"
    """symmetric or asymmetric, as for weights."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """dynamic: range from each token's values; static: one range, an exponential moving average
    (momentum 0.95) of the batch min/max seen in training, fixed in evaluation."""
    schedule_offset: Int = Field(1000, ge=0)
    """Engine step from which activations are quantized."""


class ActivationQuantParams(ConfigSection):
    bits: Literal[4, 8]
    """Activation bits (DeepSpeed supports 4 and 8)."""


class ActivationQuantGroup(_Group):
    params: ActivationQuantParams
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class ActivationQuantization(_Technique):
    """`activation_quantization`: fake-quantize each grouped module's input."""

    shared_parameters: ActivationQuantShared = Field(default_factory=ActivationQuantShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, ActivationQuantGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""


# --------------------------------------------------------------------------- pruning


class DenseRatio(ConfigSection):
    dense_ratio: Float = Field(gt=0.0, le=1.0)
    """Fraction of weights (rows, heads, channels) kept."""


class SparsePruningShared(ConfigSection):
    enabled: Bool = False
    """Prune individual weights of the grouped modules."""
    method: str = "l1"
    """l1: mask by weight magnitude, computed when pruning starts (and at each ramp stride); topk:
    a learned score per weight, the top dense_ratio kept (straight-through gradient to the scores)."""
    schedule_offset: Int = Field(1000, ge=0)
    """Engine step from which weights are masked."""
    schedule_offset_end: Int | None = Field(None, ge=0)
    """End of the dense-ratio ramp (default: schedule_offset, i.e. no ramp)."""
    schedule_offset_stride: Int = Field(1, ge=1)
    """Steps between mask updates during the ramp."""
    block_pattern: str | None = None
    """"N:M": keep N weights in every M consecutive inputs of a row (2:4 for sparse tensor cores);
    the groups' dense_ratio must then be N/M. Unset: unstructured."""
    dense_ratio: Float | None = Field(None, gt=0.0, le=1.0)
    """Accepted for DeepSpeed configs written for snip_momentum; the groups' dense_ratio is used."""
    excluded_modules: list[str] = Field(default_factory=list)
    """Accepted for DeepSpeed configs written for snip_momentum; no effect with l1/topk."""

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        if value == "snip_momentum":
            raise ValueError("'snip_momentum' is not supported (it needs Intel Neural Compressor); use 'l1' or 'topk'")
        if value not in ("l1", "topk"):
            raise ValueError(f"{value!r} is not allowed; use one of 'l1', 'topk'")
        return value

    @field_validator("block_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is None:
            return None
        m = re.fullmatch(r"(\d+):(\d+)", value)
        if not m or not 0 < int(m[1]) < int(m[2]):
            raise ValueError(f"{value!r} is not an N:M pattern with 0 < N < M; write e.g. \"2:4\" or drop it")
        return value

    @model_validator(mode="after")
    def _window(self) -> SparsePruningShared:
        if self.schedule_offset_end is None:
            self.schedule_offset_end = self.schedule_offset
        if self.schedule_offset_end < self.schedule_offset:
            raise ValueError(
                f"schedule_offset_end: {self.schedule_offset_end} < schedule_offset {self.schedule_offset}; "
                "set schedule_offset_end >= schedule_offset"
            )
        return self

    def nm(self) -> tuple[int, int] | None:
        """The (N, M) of `block_pattern`, or None for unstructured pruning."""
        if self.block_pattern is None:
            return None
        n, m = self.block_pattern.split(":")
        return int(n), int(m)


class SparsePruningGroup(_Group):
    params: DenseRatio
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class SparsePruning(_Technique):
    """`sparse_pruning`: unstructured or N:M weight masks."""

    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, SparsePruningGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""

    @model_validator(mode="after")
    def _nm_ratio(self) -> SparsePruning:
        nm = self.shared_parameters.nm()
        if nm is None:
            return self
        for name, group in self.different_groups.items():
            if abs(group.params.dense_ratio - nm[0] / nm[1]) > 1e-9:
                raise ValueError(
                    f"different_groups.{name}.params.dense_ratio: {group.params.dense_ratio} with block_pattern "
                    f"{self.shared_parameters.block_pattern}; set it to {nm[0] / nm[1]}"
                )
        return self


class RowPruningShared(ConfigSection):
    enabled: Bool = False
    """Prune output rows (neurons) of the grouped linear layers."""
    method: PruneMethod = "l1"
    """l1: by each row's L1 norm at the start; topk: a learned score per row."""
    schedule_offset: Int = Field(1000, ge=0)
    """Engine step from which rows are masked."""


class RowPruningGroup(_Group):
    params: DenseRatio
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class RowPruning(_Technique):
    """`row_pruning`: structured pruning of output rows; related modules lose the matching inputs."""

    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, RowPruningGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""


class HeadPruningShared(ConfigSection):
    enabled: Bool = False
    """Prune attention heads through the attention output projection of the grouped modules."""
    method: PruneMethod = "topk"
    """topk: a learned score per head (DeepSpeed's only method); l1: by the L1 norm of each head's
    input columns of the output projection."""
    schedule_offset: Int = Field(1000, ge=0)
    """Engine step from which heads are masked."""
    num_heads: Int | None = Field(None, ge=1)
    """Heads of the attention the output projection belongs to (required when enabled)."""

    @model_validator(mode="after")
    def _heads(self) -> HeadPruningShared:
        if self.enabled and self.num_heads is None:
            raise ValueError("num_heads: required when head pruning is enabled; set the model's head count")
        return self


class HeadPruningGroup(_Group):
    params: DenseRatio
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class HeadPruning(_Technique):
    """`head_pruning`: heads removed from the output projection (columns) and the related QKV (rows)."""

    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, HeadPruningGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""


class ChannelPruningShared(ConfigSection):
    enabled: Bool = False
    """Prune output channels of the grouped Conv2d layers."""
    method: PruneMethod = "l1"
    """l1: by each filter's L1 norm at the start; topk: a learned score per channel."""
    schedule_offset: Int = Field(1000, ge=0)
    """Engine step from which channels are masked."""


class ChannelPruningGroup(_Group):
    params: DenseRatio
    """This group's settings (merged with shared_parameters, which win on a clash)."""


class ChannelPruning(_Technique):
    """`channel_pruning`: structured pruning of Conv2d output channels."""

    shared_parameters: ChannelPruningShared = Field(default_factory=ChannelPruningShared)
    """Switch, method and schedule, common to every group."""
    different_groups: dict[str, ChannelPruningGroup] = Field(default_factory=dict)
    """Named groups: their own params and the modules they apply to."""


# --------------------------------------------------------------------------- layer reduction


class LayerReduction(ConfigSection):
    """`layer_reduction`: a shallower student initialized from chosen teacher layers (then distilled)."""

    enabled: Bool = False
    """Initialize the student from the teacher in `init_compression` (a teacher_model is required)."""
    keep_number_layer: Int | None = Field(None, ge=1)
    """Layers of the student; must equal the length of teacher_layer."""
    module_name_prefix: str | None = None
    """Name of the layer list in both models, e.g. "bert.encoder.layer" or "gpt.blocks"."""
    teacher_layer: list[Int] = Field(default_factory=list)
    """Teacher layer copied into each student layer, in order (student layer i <- teacher_layer[i])."""
    other_module_name: list[str] = Field(default_factory=list)
    """Other modules copied from the teacher as a whole (embeddings, final norm, head)."""

    @model_validator(mode="after")
    def _complete(self) -> LayerReduction:
        if not self.enabled:
            return self
        if not self.module_name_prefix or not self.teacher_layer:
            raise ValueError("module_name_prefix: layer reduction needs module_name_prefix and teacher_layer; set both")
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ValueError(
                f"keep_number_layer: {self.keep_number_layer} != {len(self.teacher_layer)} teacher_layer entries; "
                "list one teacher layer per kept layer"
            )
        return self


class CompressionConfig(ConfigSection):
    """`compression_training`: the DeepSpeed Compression techniques, applied by `init_compression`."""

    weight_quantization: WeightQuantization = Field(default_factory=WeightQuantization)
    """Quantization-aware training of weights."""
    activation_quantization: ActivationQuantization = Field(default_factory=ActivationQuantization)
    """Quantization of layer inputs."""
    sparse_pruning: SparsePruning = Field(default_factory=SparsePruning)
    """Unstructured or N:M weight pruning."""
    row_pruning: RowPruning = Field(default_factory=RowPruning)
    """Pruning of output rows (neurons)."""
    head_pruning: HeadPruning = Field(default_factory=HeadPruning)
    """Pruning of attention heads."""
    channel_pruning: ChannelPruning = Field(default_factory=ChannelPruning)
    """Pruning of conv output channels."""
    layer_reduction: LayerReduction = Field(default_factory=LayerReduction)
    """A shallower student initialized from teacher layers."""

    def techniques(self) -> dict[str, Any]:
        """The enabled layer-wise techniques by DeepSpeed name (layer reduction is not layer-wise)."""
        names = ("weight_quantization", "activation_quantization", "sparse_pruning",
                 "row_pruning", "head_pruning", "channel_pruning")
        return {n: getattr(self, n) for n in names if getattr(self, n).shared_parameters.enabled}
