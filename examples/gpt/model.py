"""A tiny GPT (pre-LN decoder) and a deterministic synthetic token data set.

Used by the example job, the engine's tests and the benchmarks, so every number in the project is
measured on the same model. Sizes are small enough to train on two CPU ranks in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (batch, seq, d_model)
        # Widths come from n_heads and the projections, not from d_model, so a model whose heads were
        # pruned (fewer heads of the same head_dim) still runs.
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        # (batch, heads, seq, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); `loss(batch)` gives the mean next-token loss."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        # Positions carry the batch dimension (batch, seq), not just arange(seq): the same rows, but every
        # layer then sees one input per example, which DP-SGD's per-sample gradients need.
        positions = torch.arange(t, device=idx.device).expand(b, t)
        x = self.tok(idx) + self.pos(positions)  # (batch, seq, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (batch, seq, vocab)


class GPTWithLoss(nn.Module):
    """TinyGPT whose forward takes a batch {'input_ids', 'labels'} and returns the scalar loss,
    the calling convention `engine(batch)` / `engine.backward(loss)` expects."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.gpt = TinyGPT(cfg)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.gpt(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic token sequences with learnable structure (each sequence counts up by a fixed
    stride from a random start, modulo the vocabulary), so the loss falls quickly."""

    def __init__(self, *, num_samples: int = 4096, seq_len: int = 64, vocab_size: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        stride = torch.randint(1, 8, (num_samples, 1), generator=g)
        steps = torch.arange(seq_len + 1).unsqueeze(0)
        self.tokens = (start + stride * steps) % vocab_size  # (num_samples, seq_len + 1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.tokens[i]
        return {"input_ids": row[:-1], "labels": row[1:]}
