"""Cross-entropy over large vocabularies: fused log-softmax + NLL with ignore_index, label smoothing
and reduction; the gradient is produced in the same pass as the loss.

For users' model and loss code, as `cross_entropy(logits, target, ...)` (the `torch.nn.functional`
meaning); nothing in deepfleet calls it yet. The pure-torch functions here are the specification and the
CPU path; `deepfleet::cross_entropy` is the custom op that dispatches to them or to
`kernels/_triton/cross_entropy.py` (see `_dispatch`).

Why hand-written: eager torch upcasts and keeps the whole (rows, vocab) log-softmax for the backward pass;
at vocab 50k+ that dominates peak memory. Here the forward walks each row in vocab chunks (online
max/sum-exp), never holds the logits in fp32 at once, and writes d(loss_row)/d(logits) in the logits'
dtype while the row is hot; the backward only scales it by the incoming per-row gradient. That scaling
is out of place (one more buffer while the backward runs): scaling the saved buffer in place would save
it, but AOT autograd (torch.compile) rejects a backward that mutates a saved forward output.

Precision: all math in fp32 (float64 stays float64); per-row losses are fp32; gradients are in the
logits' dtype. Shapes: logits (rows, vocab), target (rows,) int64, per-row loss (rows,).
Per row, with lse = logsumexp(x) and smoothing e: loss = lse - (1 - e) * x[target] - e * mean(x);
rows whose target is ignore_index have loss 0 and gradient 0; "mean" divides by the non-ignored rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton

REDUCTIONS = ("mean", "sum", "none")
REFERENCE_CHUNK_ROWS = 256  # rows per fp32 chunk on the reference path


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _reduce(losses: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()  # 0/0 = nan when every row is ignored, as torch does


def cross_entropy_reference(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """The specification: differentiable pure torch in fp32, loss in fp32."""
    logp = torch.log_softmax(logits.to(_acc_dtype(logits)), dim=-1)  # (rows, vocab)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    losses = torch.where(valid, (1 - label_smoothing) * nll + label_smoothing * smooth, 0.0)
    return _reduce(losses, valid, reduction)


def cross_entropy_forward_reference(
    logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, compute_grad: bool
) -> tuple[Tensor, Tensor]:
    """Per-row losses (rows,) and, if asked, d(loss_row)/d(logits) (rows, vocab) in the logits' dtype.

    Works through REFERENCE_CHUNK_ROWS rows at a time so only one chunk is ever in fp32.
    """
    rows, vocab = logits.shape
    acc = _acc_dtype(logits)
    losses = torch.zeros(rows, dtype=acc, device=logits.device)
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
    for start in range(0, rows, REFERENCE_CHUNK_ROWS):
        sl = slice(start, start + REFERENCE_CHUNK_ROWS)
        x = logits[sl].to(acc)  # (chunk, vocab)
        t = target[sl]
        valid = t != ignore_index
        safe = torch.where(valid, t, 0).unsqueeze(-1)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        row_loss = lse.squeeze(-1) - (1 - label_smoothing) * x.gather(-1, safe).squeeze(-1)
        row_loss = row_loss - label_smoothing * x.mean(-1)
        losses[sl] = torch.where(valid, row_loss, 0.0)
        if compute_grad:
            g = torch.exp(x - lse) - label_smoothing / vocab
            g.scatter_add_(-1, safe, torch.full_like(x[:, :1], -(1 - label_smoothing)))
            grad[sl] = (g * valid.unsqueeze(-1)).to(logits.dtype)
    return losses.float() if acc != torch.float64 else losses, grad


def cross_entropy_backward_reference(row_grad: Tensor, dloss: Tensor) -> Tensor:
    """d(total)/d(logits) = d(loss_row)/d(logits) * dloss_row, in the logits' dtype (chunked)."""
    out = torch.empty_like(row_grad)
    for start in range(0, row_grad.shape[0], REFERENCE_CHUNK_ROWS):
        sl = slice(start, start + REFERENCE_CHUNK_ROWS)
        acc = _acc_dtype(row_grad)
        out[sl] = (row_grad[sl].to(acc) * dloss[sl].to(acc).unsqueeze(-1)).to(row_grad.dtype)
    return out


@torch.library.custom_op("deepfleet::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, compute_grad: bool
) -> tuple[Tensor, Tensor]:
    """Returns (per-row loss (rows,), per-row gradient (rows, vocab), or an empty tensor)."""
    if use_triton(logits, target):
        return triton_module("cross_entropy").cross_entropy_forward(
            logits, target, ignore_index, label_smoothing, compute_grad
        )
    return cross_entropy_forward_reference(logits, target, ignore_index, label_smoothing, compute_grad)


@cross_entropy_op.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, compute_grad: bool):
    loss_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    losses = logits.new_empty(logits.shape[:1], dtype=loss_dtype)
    return losses, (torch.empty_like(logits) if compute_grad else logits.new_empty(0))


@torch.library.custom_op("deepfleet::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(row_grad: Tensor, dloss: Tensor) -> Tensor:
    """Scales each row of the saved per-row gradient by the incoming gradient of that row's loss."""
    if use_triton(row_grad, dloss):
        return triton_module("cross_entropy").cross_entropy_backward(row_grad, dloss)
    return cross_entropy_backward_reference(row_grad, dloss)


@cross_entropy_backward_op.register_fake
def _(row_grad: Tensor, dloss: Tensor) -> Tensor:
    return torch.empty_like(row_grad)


def _setup_context(ctx, inputs, output) -> None:
    ctx.compute_grad = inputs[4]
    ctx.save_for_backward(output[1])


def _backward(ctx, dloss: Tensor, _dgrad: Tensor) -> tuple[Tensor, None, None, None, None]:
    if not ctx.compute_grad:
        raise RuntimeError("cross_entropy was called with compute_grad=False; its gradient was not kept")
    (row_grad,) = ctx.saved_tensors
    return cross_entropy_backward_op(row_grad, dloss), None, None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of logits (rows, vocab) against integer targets (rows,); loss in fp32.

    Targets must lie in [0, vocab) or equal ignore_index.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use one of {', '.join(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be (rows, vocab) and target "
            f"{tuple(target.shape)} must be (rows,); flatten leading dims first"
        )
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    losses, _ = cross_entropy_op(logits, target, ignore_index, float(label_smoothing), compute_grad)
    return _reduce(losses, target != ignore_index, reduction)
