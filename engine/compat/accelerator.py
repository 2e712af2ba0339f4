"""DeepSpeed's accelerator abstraction (`deepspeed.accelerator.get_accelerator()`), over torch's device APIs.

Scripts written for DeepSpeed ask the accelerator, not `torch.cuda`, for their device, seeds, streams and
memory figures, so they run on whatever DeepSpeed supports. This adapter answers for the two devices the
engine trains on: CUDA when torch sees a GPU, else the CPU (where DeepSpeed's CPU accelerator reports one
"device" per process and host-memory figures). The answers are the engine's own: `current_device_name()`
is the device `engine.initialize` puts the model on (`deepfleet.engine.dist.training_device`), and
`communication_backend_name()` the backend `init_distributed` picks. Re-exported at
`deepfleet.engine.accelerator`; `DEEPFLEET_ACCELERATOR=cpu|cuda` (or DeepSpeed's `DS_ACCELERATOR`)
forces a choice.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["CPUAccelerator", "CUDAAccelerator", "DeepFleetAccelerator", "get_accelerator", "set_accelerator"]


class DeepFleetAccelerator:
    """The methods DeepSpeed's `DeepSpeedAccelerator` exposes that training scripts call."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    # --- device --------------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def set_device(self, device_index: int) -> None:
        """Select the device of this process (a no-op on the CPU)."""

    def device_count(self) -> int:
        raise NotImplementedError

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued work on the device (nothing is queued on the CPU)."""

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    # --- random --------------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # --- dtypes and features -------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def is_triton_supported(self) -> bool:
        return False

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def amp(self) -> Any:
        return torch.amp

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    # --- memory (bytes) ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Return cached blocks to the device (the CPU allocator keeps none)."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        raise NotImplementedError

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.memory_allocated(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def available_memory(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.memory_allocated(device_index),
                "allocated_bytes.all.peak": self.max_memory_allocated(device_index)}

    # --- streams and events --------------------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's attribute name
        return torch.Stream

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's attribute name
        return torch.Event

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return None

    def default_stream(self, device_index: int | None = None) -> Any:
        return None

    # --- tensor types (DeepSpeed scripts use these to allocate on the device) ------------------------
    def _tensor(self, dtype: torch.dtype):  # noqa: ANN202
        def make(*args: Any) -> torch.Tensor:
            if len(args) == 1 and not isinstance(args[0], int):
                return torch.as_tensor(args[0], dtype=dtype, device=self._name)
            return torch.empty(*args, dtype=dtype, device=self._name)
        return make

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.float32)

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.bfloat16)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.float16)

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.int64)

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.int32)

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.uint8)

    @property
    def BoolTensor(self) -> Any:  # noqa: N802
        return self._tensor(torch.bool)

    def __repr__(self) -> str:
        return f"<deepfleet accelerator {self._name}>"


class CPUAccelerator(DeepFleetAccelerator):
    """One CPU "device" per process, as DeepSpeed's CPU accelerator counts, always named "cpu" (an index
    is ignored: `tensor.to(get_accelerator().device_name(local_rank))` stays on the host); memory
    figures are the process's resident set (allocated) and its peak, and the host's total and available
    memory."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def memory_allocated(self, device_index: int | None = None) -> int:
        import psutil

        return int(psutil.Process().memory_info().rss)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        import resource

        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return max(int(peak_kib) * 1024, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """The kernel's peak-RSS counter cannot be reset; the peak stays the process's."""

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().available)


class CUDAAccelerator(DeepFleetAccelerator):
    """torch.cuda behind DeepSpeed's names."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def random(self) -> Any:
        return torch.cuda.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return torch.cuda.get_device_capability()[0] >= 7

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return torch.cuda.memory_stats(device_index)

    @property
    def Stream(self) -> Any:  # noqa: N802
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)


_ACCELERATOR: list[DeepFleetAccelerator] = []  # the chosen one, created on first use


def _choose() -> DeepFleetAccelerator:
    forced = os.environ.get("DEEPFLEET_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced not in (None, "", "cpu", "cuda"):
        raise ValueError(f"DEEPFLEET_ACCELERATOR/DS_ACCELERATOR: {forced!r} is not supported; use cpu or cuda")
    if forced == "cuda" and not torch.cuda.is_available():
        raise ValueError("DEEPFLEET_ACCELERATOR/DS_ACCELERATOR=cuda, but torch sees no GPU; unset it or use cpu")
    if forced == "cuda" or (forced != "cpu" and torch.cuda.is_available()):
        return CUDAAccelerator()
    return CPUAccelerator()


def get_accelerator() -> DeepFleetAccelerator:
    """The accelerator of this process (CUDA when torch sees a GPU, else the CPU), one object per process."""
    if not _ACCELERATOR:
        _ACCELERATOR.append(_choose())
    return _ACCELERATOR[0]


def set_accelerator(accel_obj: DeepFleetAccelerator) -> None:
    """Make `accel_obj` the process's accelerator (DeepSpeed's override hook)."""
    _ACCELERATOR[:] = [accel_obj]

