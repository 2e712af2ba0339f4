"""The GPU fast path of block-sparse attention: torch's `flex_attention` with a `BlockMask` built from a
sparsity layout.

Called by `SparseSelfAttention.forward` on CUDA tensors when no mask beyond the layout is given (and by
the benchmarks). flex_attention skips the blocks the mask marks empty and has a fused backward on GPU,
so it is the fast path there; on CPU it has no backward (torch 2.13), so training on CPU uses
`deepfleet.kernels.block_sparse_attention`, and this path is only checked forward, under no_grad.
The mask is the layout's blocks at token level (plus the causal triangle when `causal`); the
`BlockMask` is built with the layout's block size, so flex visits exactly the layout's tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor


def layout_block_mask(layout: Tensor, *, block: int, causal: bool, device: torch.device | str):
    """A flex `BlockMask` for a (heads, nb, nb) layout over nb * block tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    heads, nb, _ = layout.shape
    lay = layout.to(device=device, dtype=torch.bool)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = lay[h, q_idx // block, kv_idx // block]
        return keep & (kv_idx <= q_idx) if causal else keep

    return create_block_mask(mask_mod, B=None, H=heads, Q_LEN=nb * block, KV_LEN=nb * block, device=device,
                             BLOCK_SIZE=block)


def flex_block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: Tensor, *, block: int, causal: bool,
                                scale: float | None = None, block_mask=None) -> Tensor:
    """q, k, v (B, H, S, D) -> (B, H, S, D) attention restricted to the layout (see the module docstring)."""
    from torch.nn.attention.flex_attention import flex_attention

    if block_mask is None:
        block_mask = layout_block_mask(layout, block=block, causal=causal, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
