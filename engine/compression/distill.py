"""Knowledge distillation from a teacher: logit KL and hidden-state MSE, as helpers a training loop calls.

Used with layer reduction (a student initialized from chosen teacher layers, `compress.py`) or any
compressed student. DeepSpeed left the loss to the user's script; these are the two standard terms:

    logit loss  = T^2 * KL(softmax(teacher / T) || softmax(student / T))   (mean over tokens)
    hidden loss = mean over mapped layer pairs of MSE(student_layer_i, teacher_layer_teacher_layer[i])

`HiddenStates` records the outputs of a model's layers with forward hooks, so neither model has to
return its hidden states (hooks keep working under every ZeRO stage: FSDP2 leaves the modules in place).
The teacher runs in eval mode under no_grad on every rank (it is not trained and not sharded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def logit_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """T^2-scaled KL divergence of the teacher's softened distribution from the student's, per token.
    Logits are (..., vocab); the mean runs over every leading position."""
    t = float(temperature)
    s = F.log_softmax(student_logits.float().flatten(0, -2) / t, dim=-1)  # (tokens, vocab)
    p = F.log_softmax(teacher_logits.detach().float().flatten(0, -2) / t, dim=-1)
    return F.kl_div(s, p, log_target=True, reduction="batchmean") * t * t


def hidden_mse_loss(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layer pairs of the MSE between student and (detached) teacher hidden states."""
    if len(student_hidden) != len(teacher_hidden) or not student_hidden:
        raise ValueError(f"hidden states: {len(student_hidden)} student vs {len(teacher_hidden)} teacher layers; "
                         "map one teacher layer to each student layer")
    losses = [F.mse_loss(s.float(), t.detach().float()) for s, t in zip(student_hidden, teacher_hidden, strict=True)]
    return torch.stack(losses).mean()


class HiddenStates:
    """Records the outputs of `model.<prefix>.<i>` for the given layer indices on every forward."""

    def __init__(self, model: nn.Module, *, prefix: str, layers: list[int]) -> None:
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = []
        for i in layers:
            module = model.get_submodule(f"{prefix}.{i}")
            self._handles.append(module.register_forward_hook(self._hook(i)))
        self.layers = list(layers)

    def _hook(self, i: int) -> Any:
        def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return record

    def take(self) -> list[torch.Tensor]:
        """The recorded outputs in layer order (cleared for the next forward)."""
        missing = [i for i in self.layers if i not in self.outputs]
        if missing:
            raise RuntimeError(f"layers {missing} did not run in the last forward")
        out = [self.outputs[i] for i in self.layers]
        self.outputs = {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class Distiller:
    """Logit + hidden-state distillation of `student` from `teacher` over the layer map of
    `layer_reduction` (student layer i <- teacher layer teacher_layer[i]).

    Use: `teacher_logits = distiller.teacher_forward(inputs)` then, after the student's forward,
    `loss = task_loss + distiller.loss(student_logits, teacher_logits)`."""

    def __init__(self, student: nn.Module, teacher: nn.Module, *, module_name_prefix: str,
                 teacher_layer: list[int], temperature: float = 1.0, logit_weight: float = 1.0,
                 hidden_weight: float = 1.0) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.logit_weight, self.hidden_weight = temperature, logit_weight, hidden_weight
        self._student = HiddenStates(student, prefix=module_name_prefix, layers=list(range(len(teacher_layer))))
        self._teacher = HiddenStates(teacher, prefix=module_name_prefix, layers=list(teacher_layer))

    @torch.no_grad()
    def teacher_forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.teacher(*args, **kwargs)

    def loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        kd = logit_kd_loss(student_logits, teacher_logits, temperature=self.temperature)
        if self.hidden_weight == 0:
            self._student.outputs, self._teacher.outputs = {}, {}
            return self.logit_weight * kd
        hidden = hidden_mse_loss(self._student.take(), self._teacher.take())
        return self.logit_weight * kd + self.hidden_weight * hidden
