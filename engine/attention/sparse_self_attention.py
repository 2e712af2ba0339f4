"""DeepSpeed's `SparseSelfAttention` and `BertSparseSelfAttention` modules on our block-sparse kernel.

Callers: user models (through `deepfleet.engine.ops.sparse_attention`), `SparseAttentionUtils` when it
replaces a Hugging Face BERT's self-attention, and the benchmarks. The attention itself is
`deepfleet.kernels.block_sparse_attention` (CPU reference / Triton); on CUDA, with no mask beyond the
layout, `flex_attention` with a block mask is used when `use_flex=True` (engine/attention/flex.py).

Behaviour follows DeepSpeed's module: a `master_layout` buffer built once for `max_seq_length` (and
broadcast from rank 0 on first use, through engine/comm.py, so seeded random blocks agree on every
rank); a call of length L uses its top-left (L / block)^2 corner; scores are scaled by head_dim ** -0.5;
`key_padding_mask` (batch, L) and `attn_mask` (L, L) are added ("add") or, in "mul" mode, a zero
masks the position out; `rpe` (L, L) or (heads, L, L) is added to the scores (a constant: no gradient).
Differences, on purpose: a length that is not a multiple of the block is padded inside (the padded keys
are masked and the padded queries cut off) instead of raising; a layout whose `attention` is
"unidirectional" also masks future tokens inside the diagonal blocks (`causal=None` follows the layout;
DeepSpeed left that to an `attn_mask` — passing one still works, the two masks intersect); the default
layout is `FixedSparsityConfig(num_heads=4)` (DeepSpeed's default, the abstract base, had none).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from deepfleet.engine import comm
from deepfleet.engine.attention.sparsity_config import FixedSparsityConfig, SparsityConfig
from deepfleet.kernels.block_sparse_attention import block_sparse_attention, layout_blocks

_MODES = ("add", "mul")


def _as_additive(mask: Tensor, mode: str) -> Tensor:
    """A mask in DeepSpeed's "add" or "mul" convention -> fp32 additive (0 or the value; -inf masks)."""
    if mode == "mul" or mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(mask == 0, float("-inf"))
    return mask.float()


class SparseSelfAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + masks) v over the sparsity layout's blocks (see the module docstring)."""

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *, causal: bool | None = None,
                 use_flex: bool = True) -> None:
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MODES:
                raise ValueError(f"{name}={mode!r}: use 'add' or 'mul'")
        self.sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        block = self.sparsity_config.block
        padded_max = -(-max_seq_length // block) * block
        self.register_buffer("master_layout", self.sparsity_config.make_layout(padded_max))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        layout_causal = getattr(self.sparsity_config, "attention", "bidirectional") == "unidirectional"
        self.causal = layout_causal if causal is None else causal
        self.use_flex = use_flex
        self._blocks: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

    def get_layout(self, L: int) -> Tensor:
        """The layout (heads, nb, nb) for a (block-padded) length L; broadcasts rank 0's layout once."""
        if self._need_layout_synchronization and comm.is_initialized() and comm.get_world_size() > 1:
            comm.broadcast(self.master_layout, src=0)
            self._blocks.clear()
        self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block:
            raise ValueError(f"Sequence Length, {L}, needs to be dividable by Block size {block}!")
        nb = L // block
        if nb > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {L} exceeds max_seq_length {self.master_layout.shape[-1] * block}; "
                             "build the module with a larger max_seq_length")
        return self.master_layout[..., :nb, :nb]

    def _layout_blocks(self, L: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (L, str(device))
        layout = self.get_layout(L)  # first, so a broadcast clears stale entries
        if key not in self._blocks:
            rows, cols = layout_blocks(layout.cpu())
            self._blocks[key] = (rows.to(device), cols.to(device))
        return self._blocks[key]

    def forward(self, query: Tensor, key: Tensor, value: Tensor, rpe: Tensor | None = None,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """query, key, value (batch, heads, L, head_dim) -> (batch, heads, L, head_dim). A key given as
        (batch, heads, head_dim, L) (already transposed) is accepted, as in DeepSpeed."""
        bsz, heads, length, head_dim = query.shape
        if key.shape[2] != length and key.shape[3] == length:
            key = key.transpose(2, 3)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError("only self-attention is supported for now (query, key, value shapes differ)")
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {heads} heads but the sparsity config has num_heads="
                             f"{self.sparsity_config.num_heads}")
        block = self.sparsity_config.block
        padded = -(-length // block) * block
        pad = padded - length
        if pad:
            query, key, value = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        rows, cols = self._layout_blocks(padded, query.device)
        bias = self._bias(bsz=bsz, length=length, padded=padded, rows=rows, cols=cols, rpe=rpe,
                          key_padding_mask=key_padding_mask, attn_mask=attn_mask, device=query.device)
        scale = 1.0 / math.sqrt(head_dim)
        if bias is None and self.use_flex and query.is_cuda and not pad:
            from deepfleet.engine.attention.flex import flex_block_sparse_attention

            out = flex_block_sparse_attention(query, key, value, self.get_layout(padded), block=block,
                                              causal=self.causal, scale=scale)
        else:
            out = block_sparse_attention(query, key, value, rows, cols, block=block, bias=bias, scale=scale,
                                         causal=self.causal)
        return out[:, :, :length] if pad else out

    def _bias(self, *, bsz: int, length: int, padded: int, rows: Tensor, cols: Tensor, rpe: Tensor | None,
              key_padding_mask: Tensor | None, attn_mask: Tensor | None, device: torch.device) -> Tensor | None:
        """Every additive term gathered per non-zero tile: (1 or batch, nnz, blk, blk), or None."""
        block = self.sparsity_config.block
        nb = padded // block
        pad = padded - length
        pair = torch.zeros(self.sparsity_config.num_heads, padded, padded, device=device)  # (H, S, S) terms
        has_pair = False
        if attn_mask is not None:
            m = attn_mask.squeeze()
            if m.shape != (length, length):
                raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} must squeeze to (L, L) = {(length, length)}")
            pair[:, :length, :length] += _as_additive(m.to(device), self.attn_mask_mode)
            has_pair = True
        if rpe is not None:
            r = rpe.squeeze(0) if rpe.dim() == 4 else rpe
            pair[:, :length, :length] += r.detach().float().to(device)
            has_pair = True
        keys = None
        if key_padding_mask is not None:
            kp = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            if kp.shape != (bsz, length):
                raise ValueError(f"key_padding_mask shape {tuple(key_padding_mask.shape)} must squeeze to "
                                 f"(batch, L) = {(bsz, length)}")
            keys = nn.functional.pad(_as_additive(kp.to(device), self.key_padding_mask_mode), (0, pad))
        elif pad:
            keys = torch.zeros(1, padded, device=device)
        if keys is not None and pad:
            keys[:, length:] = float("-inf")  # padded keys are never attended
        if not has_pair and keys is None:
            return None
        bias = 0
        if has_pair:
            tiles = pair.reshape(-1, nb, block, nb, block).transpose(2, 3)  # (H, nb, nb, blk, blk)
            bias = tiles[rows // nb, rows % nb, cols % nb][None]  # (1, nnz, blk, blk)
        if keys is not None:
            key_tiles = keys.reshape(keys.shape[0], nb, block)[:, cols % nb]  # (B|1, nnz, blk)
            bias = bias + key_tiles[:, :, None, :]
        return bias.expand(-1, -1, block, -1).contiguous() if bias.shape[2] == 1 else bias.contiguous()


class BertSparseSelfAttention(nn.Module):
    """A BERT self-attention layer (query/key/value projections) whose attention is `SparseSelfAttention`;
    `forward(hidden_states, attention_mask)` -> (batch, L, hidden), the mask being a key padding mask."""

    def __init__(self, config, sparsity_config: SparsityConfig | None = None) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({config.num_attention_heads})")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        sparsity = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        max_len = getattr(config, "max_position_embeddings", 2048)
        self.sparse_self_attention = SparseSelfAttention(sparsity, max_seq_length=max_len)

    def transpose_for_scores(self, x: Tensor) -> Tensor:
        """(batch, L, hidden) -> (batch, heads, L, head_dim)."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        q, k, v = (self.transpose_for_scores(f(hidden_states)) for f in (self.query, self.key, self.value))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)  # (B, H, L, D)
        return context.permute(0, 2, 1, 3).reshape(*hidden_states.shape[:-1], self.all_head_size)
