"""`init_inference`'s configuration: DeepSpeed's `DeepSpeedInferenceConfig` names and meanings.

Parsed by `engine.init_inference` from a `config=` dict and/or keyword arguments (keywords win), as
DeepSpeed does. Unknown keys are errors naming the key (`ConfigSection` forbids extras). Torch-free,
so the dtype is kept as its name. What each field does here:
- `dtype`: compute and weight dtype (DeepSpeed's default fp16; "int8" means fp32 compute with int8
  weights, i.e. weight-only quantization at 8 bits).
- `tensor_parallel.tp_size` (deprecated `mp_size`): shards the decoder over the mesh's `tp` dimension.
- `replace_with_kernel_inject` (alias `kernel_inject`): routes norms, rotary and SwiGLU through
  `deepfleet.kernels` (Triton on CUDA, the torch reference on CPU) and fuses the q/k/v and gate/up
  projections into one matmul each. The static-cache decoder runs either way.
- `quant.weight.num_bits` (8 or 4, with `quant.weight.group_size` for 4): weight-only quantization.
- `max_out_tokens`: positions per sequence in the static KV cache (prompt + generated).
- `checkpoint`: a deepfleet checkpoint directory (a root with `latest`, or one step directory) or a
  `.safetensors` file, loaded into the model before it is converted.
- `max_batch_size` (deepfleet's): sequences decoded together, i.e. KV-cache slots.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, model_validator

from deepfleet.engine.config_base import ConfigSection

_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "int8": "int8", "torch.int8": "int8",
}


def _dtype_name(value: Any) -> str:
    """Accept a torch.dtype or its usual spellings; the result is one of fp32, fp16, bf16, int8."""
    key = str(value).lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"expected one of fp32, fp16, bf16, int8 (or the torch dtype), got {value!r}")
    return _DTYPE_NAMES[key]


class TensorParallelConfig(ConfigSection):
    """DeepSpeed's DeepSpeedTPConfig."""

    enabled: bool = True
    """Whether tp_size applies."""
    tp_size: int = Field(default=1, ge=1)
    """Ranks one model is split over (the mesh's `tp` dimension)."""
    tp_group: Any = None
    """A process group to shard over instead of the mesh's `tp` sub-mesh's."""


class WeightQuantConfig(ConfigSection):
    """Weight-only quantization of the decoder's linear layers."""

    enabled: bool = True
    num_bits: Literal[4, 8] = 8
    """8: int8 codes with one fp scale per output channel; 4: int4 codes, a scale and zero per group."""
    group_size: int = Field(default=64, ge=2)
    """Input columns per int4 group (a layer whose input width it does not divide uses one group per row)."""


class ActivationQuantConfig(ConfigSection):
    enabled: bool = False
    """Activation quantization is not supported by init_inference (weights only)."""


class QuantConfig(ConfigSection):
    """DeepSpeed's `quant` section."""

    enabled: bool = True
    weight: WeightQuantConfig = WeightQuantConfig()
    activation: ActivationQuantConfig = ActivationQuantConfig()

    @model_validator(mode="after")
    def _weights_only(self) -> QuantConfig:
        if self.enabled and self.activation.enabled:
            raise ValueError("quant.activation.enabled: activation quantization is not supported; "
                             "set it to false (weight-only quantization: quant.weight.num_bits)")
        return self


class InferenceConfig(ConfigSection):
    """DeepSpeed's DeepSpeedInferenceConfig, the fields deepfleet implements."""

    dtype: Annotated[str, BeforeValidator(_dtype_name)] = "fp16"
    tensor_parallel: TensorParallelConfig = Field(
        default=TensorParallelConfig(), validation_alias=AliasChoices("tensor_parallel", "tp"))
    mp_size: int | None = Field(default=None, ge=1)
    """Deprecated spelling of tensor_parallel.tp_size."""
    replace_with_kernel_inject: bool = Field(
        default=False, validation_alias=AliasChoices("replace_with_kernel_inject", "kernel_inject"))
    quant: QuantConfig | None = None
    max_out_tokens: int = Field(default=1024, ge=2, validation_alias=AliasChoices("max_out_tokens", "max_tokens"))
    checkpoint: str | None = None
    enable_cuda_graph: bool = False
    max_batch_size: int = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _resolve(self) -> InferenceConfig:
        if self.mp_size is not None:
            if self.tensor_parallel.tp_size not in (1, self.mp_size):
                raise ValueError(f"mp_size: {self.mp_size} disagrees with tensor_parallel.tp_size "
                                 f"{self.tensor_parallel.tp_size}; give only tensor_parallel.tp_size")
            self.tensor_parallel = self.tensor_parallel.model_copy(update={"tp_size": self.mp_size})
        if self.enable_cuda_graph:
            raise ValueError("enable_cuda_graph: CUDA graphs are not supported by init_inference; set it to false")
        return self

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def weight_bits(self) -> int | None:
        """8 or 4 when weights are quantized, else None."""
        if self.quant is not None and self.quant.enabled and self.quant.weight.enabled:
            return self.quant.weight.num_bits
        return 8 if self.dtype == "int8" else None
