"""A small Mixture-of-Experts GPT: the tiny GPT of `model.py` with its MLPs replaced by DeepSpeed-style
`MoE` layers (every `moe_every`-th block), built only from the public API
(`deepfleet.engine.moe.layer.MoE`). Used by the MoE tests, `examples/gpt/train_moe.py`, the managed
loop's MoE factory and `benchmarks/moe.py`.

`MoEGPTWithLoss(batch) -> loss` = next-token cross-entropy + aux_loss_coef * sum of the layers' l_aux;
`last_aux` keeps the summed l_aux and `last_counts` each layer's exp_counts of the last forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine.moe.layer import MoE
from examples.gpt.model import Block, GPTConfig, SyntheticTokens  # noqa: F401 - SyntheticTokens re-exported


@dataclass(frozen=True)
class MoEArgs:
    """The MoE layer arguments (the config's `moe` section has the same names)."""

    num_experts: int = 4
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    use_residual: bool = False
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0
    moe_every: int = 1
    layer_ep_sizes: tuple[int, ...] = ()  # per MoE layer, in order (DeepSpeed lets layers differ); () = ep_size

    def for_layer(self, index: int) -> MoEArgs:
        """The arguments of the `index`-th MoE layer (its own ep_size when `layer_ep_sizes` gives one)."""
        if not self.layer_ep_sizes:
            return self
        return replace(self, ep_size=self.layer_ep_sizes[index % len(self.layer_ep_sizes)], layer_ep_sizes=())

    @classmethod
    def from_section(cls, section: object) -> MoEArgs:
        """From the engine config's `moe` section (a MoEConfig) or a dict with the same keys."""
        data = section if isinstance(section, dict) else section.model_dump()
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

def expert_mlp(d_model: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

class MoEBlock(nn.Module):
    """Pre-LN attention block whose MLP is an MoE layer; forward returns (x, l_aux, exp_counts)."""

    def __init__(self, cfg: GPTConfig, moe: MoEArgs) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.n_heads = cfg.n_heads
        self.moe = MoE(cfg.d_model, expert_mlp(cfg.d_model), num_experts=moe.num_experts, ep_size=moe.ep_size,
                       k=moe.k, capacity_factor=moe.capacity_factor, eval_capacity_factor=moe.eval_capacity_factor,
                       min_capacity=moe.min_capacity, use_residual=moe.use_residual,
                       noisy_gate_policy=moe.noisy_gate_policy, drop_tokens=moe.drop_tokens, use_rts=moe.use_rts,
                       # deepfleet's own argument, passed only when used, so DeepSpeed's MoE builds this model too
                       **({"bias_update_rate": moe.bias_update_rate} if moe.bias_update_rate else {}))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape  # (batch, seq, d_model)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))  # (b, heads, t, hd)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        y, l_aux, counts = self.moe(self.ln2(x))
        return x + y, l_aux, counts

class DenseBlock(nn.Module):
    """The same block with a dense MLP (l_aux 0), for the blocks between MoE layers."""

    def __init__(self, cfg: GPTConfig, d_ff: int | None = None) -> None:
        super().__init__()
        self.block = Block(cfg)
        if d_ff is not None:  # a dense MLP of another width (the equal-active-parameters baseline)
            self.block.fc, self.block.out = nn.Linear(cfg.d_model, d_ff), nn.Linear(d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.block(x), x.new_zeros(()), None

class MoEGPTWithLoss(nn.Module):
    """Token batch {'input_ids', 'labels'} -> cross-entropy + aux_loss_coef * sum(l_aux)."""

    def __init__(self, cfg: GPTConfig, moe: MoEArgs, *, dense_d_ff: int | None = None) -> None:
        super().__init__()
        self.cfg, self.moe_args = cfg, moe
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(
            DenseBlock(cfg, dense_d_ff) if dense_d_ff is not None or (i + 1) % moe.moe_every
            else MoEBlock(cfg, moe.for_layer((i + 1) // moe.moe_every - 1)) for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.last_aux = torch.zeros(())
        self.last_counts: list[torch.Tensor] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        idx = batch["input_ids"]
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))  # (b, t, d)
        aux, counts = x.new_zeros((), dtype=torch.float32), []
        for block in self.blocks:
            x, l_aux, c = block(x)
            aux = aux + l_aux
            if c is not None:
                counts.append(c)
        logits = self.head(self.ln_f(x))  # (b, t, vocab)
        self.last_aux, self.last_counts = aux.detach(), counts
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        return loss + self.moe_args.aux_loss_coef * aux
