"""The decoder the inference engine runs: one pre-norm transformer layout that GPT-2, OPT, Llama and
our example GPT all map onto (`architectures.py` converts their weights), with a static KV cache.

Called by `engine.InferenceEngine`. Why a decoder of our own instead of the wrapped module's forward:
one layout gives one place for the static cache writes (`cache.py`), per-row positions (so requests
of different lengths and requests that joined later share a decode step), plain `nn.Linear`
projections (so tensor parallelism and weight-only quantization swap them module by module, the same
way for every architecture), and the fused kernels of `deepfleet.kernels` (norm, rotary, SwiGLU)
when `replace_with_kernel_inject` is on. This is what DeepSpeed's kernel injection does with its
per-architecture policies. The kernels' dispatcher (`use_triton`) is asked per call; where it would
run the torch reference (CPU), the same math runs inline here instead of behind the custom-op
boundary, which measured 0.7-0.8x of inline speed on a small model's decode step.

Shapes: tokens and positions (batch, seq), or (1, tokens) for a packed prefill (its prompts end to
end, `attention.Packed`); hidden (batch, seq, hidden); q (batch, seq, heads, head_dim); a layer's
cache (slots, kv_heads, max_tokens, head_dim). Attention masks every key whose position is after the
query's, so rows of a batch may sit at different positions; cache positions past a row's length hold
stale keys from the slot's earlier request, masked until they are overwritten. `attention.py` holds
the attention forms (masked, packed prefill, one-query decode) and says which call uses which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepfleet.engine.inference.attention import (
    Packed,
    cache_rows,
    decode_attention,
    masked_attention,
    packed_attention,
)
from deepfleet.kernels._dispatch import use_triton
from deepfleet.kernels.layer_norm import layer_norm
from deepfleet.kernels.rms_norm import rms_norm
from deepfleet.kernels.rope import rope, rope_cos_sin
from deepfleet.kernels.swiglu import swiglu

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")
PROJECTIONS = ("q", "k", "v", "qkv", "o", "up", "down", "gate", "gate_up")  # a Layer's linear-like modules
# The transposed layout (MatmulLinear) pays only while a decode step's weights stay in the CPU's caches:
# measured on one core here, a batch-16 step's matmuls over 4 layers took 0.72x the time at 17 MB of
# weights (width 256), 1.09x at 59 MB (width 512) and 0.99x at 218 MB (width 1024, memory-bound).
MATMUL_LAYOUT_MAX_BYTES = 32 * 2**20


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the supported architectures (per-layer widths come from the weights)."""

    arch: str
    vocab_size: int
    hidden: int
    head_dim: int
    max_positions: int
    norm: str = "layer"  # "layer" (weight, bias) or "rms"
    norm_eps: float = 1e-5
    position: str = "learned"  # "learned" (a table) or "rope"
    position_offset: int = 0  # OPT's learned table starts 2 rows in
    rope_theta: float = 10000.0
    activation: str = "gelu"  # one of ACTIVATIONS
    final_norm: bool = True


class Norm(nn.Module):
    """LayerNorm or RMSNorm; through `deepfleet.kernels` when `fused` (the torch fallback on CPU)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, kind: str, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kind, self.eps, self.fused = kind, eps, False

    def forward(self, x: Tensor) -> Tensor:
        fused = self.fused and _triton(self, x, self.weight)
        if self.kind == "rms":
            if fused:
                return rms_norm(x, self.weight, self.eps)
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        if fused:
            return layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Layer(nn.Module):
    """One decoder layer: x + attn(norm1(x)), then + mlp(norm2(x)). Linears are plain nn.Linear (or a
    drop-in with the same call), so tensor parallelism and quantization replace them by name."""

    def __init__(self, *, norm1: Norm, norm2: Norm, q: nn.Module, k: nn.Module, v: nn.Module, o: nn.Module,
                 up: nn.Module, down: nn.Module, gate: nn.Module | None, n_heads: int, n_kv_heads: int,
                 head_dim: int, activation: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm1, norm2
        self.q, self.k, self.v, self.o = q, k, v, o
        self.up, self.down, self.gate = up, down, gate
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.activation, self.fused = activation, False
        self.qkv: nn.Module | None = None  # q|k|v in one projection, set by fuse_projections
        self.gate_up: nn.Module | None = None
        self.splits: list[int] | None = None
        # One-query decode attention as fused reductions instead of SDPA (attention.py): set for the
        # compiled static step, where inductor fuses it; eager it is slower.
        self.reduce_decode_attention = False

    def fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up (fewer, larger calls per decode step), when they are
        plain nn.Linear layers of one bias kind; quantization afterwards quantizes the fused ones."""
        parts = [self.q, self.k, self.v]
        if _fusable(parts):
            self.splits = [p.weight.shape[0] for p in parts]
            self.qkv, self.q, self.k, self.v = _cat(parts), None, None, None
        if self.gate is not None and _fusable([self.gate, self.up]):
            self.gate_up, self.gate, self.up = _cat([self.gate, self.up]), None, None

    def kv_width(self) -> int:
        """This rank's key (= value) projection width."""
        if self.splits is not None:
            return self.splits[1]
        weight = self.k.weight
        return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]

    def mlp(self, x: Tensor) -> Tensor:
        if self.activation == "swiglu":
            g, u = self.gate_up(x).chunk(2, dim=-1) if self.gate_up is not None else (self.gate(x), self.up(x))
            return self.down(swiglu(g, u) if self.fused and _triton(self, g, u) else F.silu(g) * u)
        h = self.up(x)
        if self.activation == "relu":
            h = F.relu(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(h)

    def forward(self, x: Tensor, positions: Tensor, *, rotary: tuple[Tensor, Tensor] | None,
                cache: tuple[Tensor, Tensor] | None, slots: Tensor | None, key_mask: Tensor | None,
                span: int | None = None, packed: Packed | None = None) -> Tensor:
        """`slots` None: the batch is cache rows 0..batch-1 in order; `span` None: keys up to the largest
        position (the static decode step passes both, so it has no data-dependent shapes); `packed`: x is
        a prefill's prompts end to end, (1, tokens, hidden), laid out as it says (`attention.py`)."""
        b, t, _ = x.shape
        a = self.norm1(x)
        # Head counts come from the (possibly sharded or pruned) projection widths.
        q, k, v = self.qkv(a).split(self.splits, dim=-1) if self.qkv is not None else (self.q(a), self.k(a), self.v(a))
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in (q, k, v))
        if rotary is not None:
            fused = self.fused and _triton(self, q, *rotary)
            q, k = _rotate(q, rotary, fused=fused), _rotate(k, rotary, fused=fused)
        if cache is None:  # the whole sequence at once, no cache (InferenceEngine.forward)
            att = masked_attention(q, k.transpose(1, 2), v.transpose(1, 2), _visible(positions, positions, key_mask))
            x = x + self.o(att)
            return x + self.mlp(self.norm2(x))
        ck, cv = cache
        if packed is not None:
            rows = packed.token_slots  # (1, tokens)
        else:
            rows = (torch.arange(b, device=x.device) if slots is None else slots)[:, None]  # (batch, 1)
        ck[rows, :, positions] = k.to(ck.dtype)  # indexed shape (batch, seq, kv_heads, head_dim)
        cv[rows, :, positions] = v.to(cv.dtype)
        if packed is not None:
            att = packed_attention(q, ck, cv, packed)
        else:
            span = int(positions.max()) + 1 if span is None else span
            kc, vc = (ck[:b], cv[:b]) if slots is None else (cache_rows(ck, slots), cache_rows(cv, slots))
            keys, values = kc[:, :, :span], vc[:, :, :span]  # (batch, kv_heads, span, head_dim)
            if t == 1 and self.reduce_decode_attention:
                att = decode_attention(q, keys, values, positions)
            else:
                key_pos = torch.arange(span, device=x.device).expand(b, span)
                att = masked_attention(q, keys, values, _visible(key_pos, positions, key_mask))
        x = x + self.o(att)
        return x + self.mlp(self.norm2(x))


def _visible(key_pos: Tensor, positions: Tensor, key_mask: Tensor | None) -> Tensor:
    """(batch, 1, seq, keys): a key is visible when it is not after the query (and is not padding)."""
    mask = key_pos[:, None, None, :] <= positions[:, None, :, None]
    if key_mask is not None:
        t = positions.shape[1]
        mask = mask & key_mask[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=positions.device)  # padded queries see themselves
    return mask


def _triton(module: nn.Module, *tensors: Tensor) -> bool:
    """Whether the fused kernels run as Triton: the dispatcher's answer, or the one `pin_kernels` fixed
    (a compiled step cannot ask the dispatcher, whose choice lives in a ContextVar)."""
    pinned = getattr(module, "triton_pinned", None)
    return use_triton(*tensors) if pinned is None else pinned


def _fusable(parts: list[nn.Module | None]) -> bool:
    return all(type(p) is nn.Linear for p in parts) and len({p.bias is None for p in parts}) == 1


def frozen_linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An inference Linear holding `weight` and `bias` as they are (no init, no gradients)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class MatmulLinear(nn.Module):
    """nn.Linear's y = x W^T + b with W kept transposed, (in_features, out_features) contiguous, so the
    matmul reads it without a transpose. Why: on CPU, fp32 GEMM at a decode step's few rows ran ~25%
    faster on this layout on the benchmark's batch-16 step (width 256), the same at 1 row and at prefill
    sizes; only while the weights stay in cache (MATMUL_LAYOUT_MAX_BYTES). `weight` is the (out, in)
    view, as nn.Linear's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        return self.weight_t.t()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)  # (rows, in)
        y = flat @ self.weight_t if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        return y.view(*x.shape[:-1], self.out_features)


def _plain_host_linear(module: nn.Module) -> bool:
    """An fp32 nn.Linear whose weight is an ordinary CPU tensor (not a tensor-parallel DTensor shard).
    fp32 only: bf16 gained ~6% on this layout at width 256 but ran 1.5x slower at width 1024."""
    return (type(module) is nn.Linear and type(module.weight) is nn.Parameter and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32)


def _cat(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    return frozen_linear(weight, bias)


def _rotate(x: Tensor, rotary: tuple[Tensor, Tensor], *, fused: bool) -> Tensor:
    """Rotary embedding with per-row positions: the (batch, seq) rows are flattened into one sequence so
    the tables (batch * seq, head_dim // 2) line up with `deepfleet.kernels.rope`'s (seq, ...) shape."""
    cos, sin = rotary
    b, t, h, d = x.shape
    flat = x.reshape(1, b * t, h, d)
    if fused:
        return rope(flat, cos, sin).view(b, t, h, d)
    half = d // 2
    xf = flat.float()
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype).view(b, t, h, d)


class Decoder(nn.Module):
    """tokens (batch, seq) and positions (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, spec: DecoderSpec, *, embed: nn.Module, pos: nn.Module | None, layers: list[Layer],
                 norm_f: Norm | None, head: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.embed, self.pos = embed, pos
        self.layers = nn.ModuleList(layers)
        self.norm_f, self.head = norm_f, head
        if spec.position == "rope":
            cos, sin = rope_cos_sin(spec.max_positions, spec.head_dim, base=spec.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def use_fused_kernels(self, on: bool) -> None:
        """replace_with_kernel_inject: route norms, rotary and SwiGLU through `deepfleet.kernels` and fuse
        the q/k/v and gate/up projections (each into one matmul)."""
        for m in self.modules():
            if isinstance(m, (Norm, Layer)):
                m.fused = on
        if on:
            for layer in self.layers:
                layer.fuse_projections()

    def use_matmul_layout(self, on: bool, *, max_bytes: int = MATMUL_LAYOUT_MAX_BYTES) -> None:
        """With kernel injection, on CPU: every fp32 nn.Linear projection still left (after fusion and
        quantization) and an untied head become `MatmulLinear`, when those weights add up to at most
        `max_bytes` (see MATMUL_LAYOUT_MAX_BYTES). The decoder then holds its own copies of them, as it
        already did of the fused ones; a head tied to the embedding is left as it is (a transposed copy
        of the vocabulary table would cost its size again)."""
        if not on:
            return
        slots = [(layer, name) for layer in self.layers for name in PROJECTIONS
                 if _plain_host_linear(getattr(layer, name))]
        if _plain_host_linear(self.head) and self.head.weight is not getattr(self.embed, "weight", None):
            slots.append((self, "head"))
        if sum(getattr(owner, name).weight.nbytes for owner, name in slots) > max_bytes:
            return
        for owner, name in slots:
            setattr(owner, name, MatmulLinear(getattr(owner, name)))

    def pin_kernels(self) -> None:
        """Fix the dispatcher's choice (Triton or the inline torch math) for every fused module now, as it
        answers for this decoder's weights; `compiled.py` calls it before tracing the step."""
        for m in self.modules():
            if isinstance(m, (Norm, Layer)):
                weight = next(m.parameters(), None)
                m.triton_pinned = bool(m.fused and weight is not None and use_triton(weight))

    def forward(self, tokens: Tensor, positions: Tensor, *, cache: list[tuple[Tensor, Tensor]] | None = None,
                slots: Tensor | None = None, key_mask: Tensor | None = None, take: Tensor | None = None,
                span: int | None = None, packed: Packed | None = None) -> Tensor:
        """`take` (batch,): keep only that sequence index of each row (the last real token of a prefill);
        `slots`, `span`, `packed`: as `Layer.forward` (with a cache, `slots` None means rows 0..batch-1).
        A packed prefill: tokens and positions (1, tokens), logits (prompts, 1, vocab) at `packed.last`."""
        spec = self.spec
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(positions + spec.position_offset)
        rotary = None
        if spec.position == "rope":
            flat = positions.reshape(-1)
            rotary = (self.rope_cos[flat], self.rope_sin[flat])
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rotary=rotary, cache=None if cache is None else cache[i], slots=slots,
                      key_mask=key_mask, span=span, packed=packed)
        if packed is not None:
            take = packed.last
        if take is not None:  # (batch, seq) or, packed, (1, tokens): the row index broadcasts
            x = x[torch.arange(x.shape[0], device=x.device), take][:, None]
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.head(x)
