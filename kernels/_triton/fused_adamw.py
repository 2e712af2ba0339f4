"""Triton fused AdamW; the specification is `kernels/fused_adamw.py`.

Called only through `deepfleet::fused_adamw` when the Triton path is selected. The whole group is one
launch, however many tensors it holds: the host writes a small table (each tensor's address per role,
its size, and which tensor and offset each BLOCK-sized program covers) and every program casts its
tensor's addresses back to typed pointers (the grouped-GEMM pattern of the Triton tutorials). A ZeRO
flat buffer is simply a group of one. Tensors of one role must share a dtype (a compile-time constant).
With a grad_scale, a first launch unscales and checks every gradient (one atomic max per program into
`found_inf`) and the update launch reads `found_inf` on the device and writes nothing when it is set:
no host sync.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepfleet.kernels._triton.launch import elementwise_block

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _locate(numel_ptr, blk_tensor_ptr, blk_start_ptr, BLOCK: tl.constexpr):
    """(tensor index, element offsets, mask) of this program's slice of the group."""
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    offs = tl.load(blk_start_ptr + pid) + tl.arange(0, BLOCK)
    return t, offs, offs < tl.load(numel_ptr + t)


@triton.jit
def _check_finite(
    g_tab, numel_ptr, blk_tensor_ptr, blk_start_ptr, scale_ptr, found_ptr, G_DT: tl.constexpr, BLOCK: tl.constexpr
):
    t, offs, mask = _locate(numel_ptr, blk_tensor_ptr, blk_start_ptr, BLOCK)
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(G_DT))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(scale_ptr).to(tl.float32)
    bad = tl.max(tl.where(tl.abs(g) < float("inf"), 0, 1), axis=0)  # nan fails the comparison too
    tl.atomic_max(found_ptr, bad)


@triton.jit
def _adamw(
    p_tab, g_tab, m_tab, v_tab, model_tab, numel_ptr, blk_tensor_ptr, blk_start_ptr, scale_ptr, found_ptr,
    lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt,
    P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr, MODEL_DT: tl.constexpr,
    HAS_MODEL: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = _locate(numel_ptr, blk_tensor_ptr, blk_start_ptr, BLOCK)
    if HAS_SCALE:
        mask = mask & (offs < tl.where(tl.load(found_ptr) == 0, offs + 1, 0))  # overflow: touch nothing
    p_ptr = tl.load(p_tab + t).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(G_DT))
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(M_DT))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(V_DT))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32) * (1.0 - lr * weight_decay)
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(P_DT), mask=mask)
    tl.store(m_ptr + offs, m.to(M_DT), mask=mask)
    tl.store(v_ptr + offs, v.to(V_DT), mask=mask)
    if HAS_MODEL:
        model_ptr = tl.load(model_tab + t).to(tl.pointer_type(MODEL_DT))
        tl.store(model_ptr + offs, p.to(MODEL_DT), mask=mask)


def _role_dtype(role: str, tensors: list[torch.Tensor]) -> tl.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in TL_DTYPES:
        raise ValueError(
            f"fused_adamw (triton): {role} must share one dtype of fp32/bf16/fp16 across the group; "
            f"got {sorted(str(d) for d in dtypes)}"
        )
    return TL_DTYPES[next(iter(dtypes))]


def _tables(roles: list[list[torch.Tensor]], block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Device tables: one address table per role, numels, and each program's (tensor, start offset)."""
    numels = torch.tensor([t.numel() for t in roles[0]], dtype=torch.int64)
    blocks = (numels + block - 1) // block  # programs per tensor
    blk_tensor = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    blk_start = (torch.arange(int(blocks.sum())) - first[blk_tensor]) * block
    addresses = [torch.tensor([t.data_ptr() for t in role], dtype=torch.int64) for role in roles]
    packed = torch.cat([*addresses, numels, blk_tensor, blk_start]).to(device, non_blocking=True)
    return packed.split([*(len(a) for a in addresses), len(numels), len(blk_tensor), len(blk_start)])


def fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    model_params: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> torch.Tensor:
    device = params[0].device
    found = torch.zeros((), dtype=torch.int32, device=device)
    roles = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if model_params:
        roles["model_params"] = model_params
    if not all(t.is_contiguous() for role in roles.values() for t in role):
        raise ValueError("fused_adamw (triton): every tensor must be contiguous; pass flat buffers or .contiguous()")
    dts = {role: _role_dtype(role, tensors) for role, tensors in roles.items()}
    block = elementwise_block(device)
    *tabs, numels, blk_tensor, blk_start = _tables(list(roles.values()), block, device)
    programs = blk_tensor.numel()
    if programs == 0:
        return found.to(torch.float32)
    p_tab, g_tab, m_tab, v_tab = tabs[:4]
    model_tab = tabs[4] if model_params else p_tab  # unread when HAS_MODEL is False
    scale = grad_scale if grad_scale is not None else found  # unread when HAS_SCALE is False
    if grad_scale is not None:
        _check_finite[(programs,)](g_tab, numels, blk_tensor, blk_start, grad_scale, found, G_DT=dts["grads"], BLOCK=block)
    _adamw[(programs,)](
        p_tab, g_tab, m_tab, v_tab, model_tab, numels, blk_tensor, blk_start, scale, found,
        lr, beta1, beta2, eps, weight_decay, 1 - beta1**step, math.sqrt(1 - beta2**step),
        P_DT=dts["params"], G_DT=dts["grads"], M_DT=dts["exp_avgs"], V_DT=dts["exp_avg_sqs"],
        MODEL_DT=dts.get("model_params", dts["params"]), HAS_MODEL=bool(model_params),
        HAS_SCALE=grad_scale is not None, BLOCK=block,
    )  # fmt: skip
    return found.to(torch.float32)
