"""Map a supported causal LM onto `decoder.Decoder`: DeepSpeed's injection policies, ours.

Called by `engine.init_inference`. Supported: Hugging Face Transformers' GPT-2 (`GPT2LMHeadModel`),
OPT (`OPTForCausalLM`, pre-norm variants) and Llama (`LlamaForCausalLM`, default rotary), recognized
by `config.model_type`, and deepfleet's example GPT (`examples/gpt/model.py`: `TinyGPT`, or
`GPTWithLoss` around it), recognized by its module layout. Anything else raises ValueError naming the
architecture and what is supported.

The decoder shares the source model's weight storage where the layout is the same; fused projections
(GPT-2's `c_attn`, the example GPT's `qkv`) are split into q/k/v rows so tensor parallelism can shard
each one; GPT-2's Conv1D weights are transposed into nn.Linear layout. Layers a compressed model was
cleaned into (`engine/compression/quantized.py`: integer codes, pruned rows and heads) are taken as
they are, split by rows where fused, so their codes are kept bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deepfleet.engine.compression.quantized import QuantizedLinear, QuantizedWeight
from deepfleet.engine.inference.decoder import Decoder, DecoderSpec, Layer, Norm

SUPPORTED = "GPT-2 (gpt2), OPT (opt), Llama (llama) from Hugging Face Transformers, and deepfleet's example GPT"


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return lin


def _copy(module: nn.Module) -> nn.Module:
    """A linear-like module as the decoder holds it (plain nn.Linear copied, quantized kept)."""
    if isinstance(module, nn.Linear):
        return _linear(module.weight, module.bias)
    return module


def _rows_of(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    part = QuantizedWeight.__new__(QuantizedWeight)
    nn.Module.__init__(part)
    part.bits, part.symmetric, part.packed = weight.bits, weight.symmetric, weight.packed
    part.shape = (stop - start, *weight.shape[1:])
    for name in ("codes", "scale", "zero"):
        part.register_buffer(name, getattr(weight, name)[start:stop].clone())
    return part


def split_rows(module: nn.Module, parts: int) -> list[nn.Module]:
    """A fused projection (nn.Linear or a cleaned QuantizedLinear) as `parts` equal row blocks."""
    out_features = module.weight.shape[0]
    if out_features % parts:
        raise ValueError(f"fused projection: {out_features} outputs do not split into {parts} equal parts")
    n = out_features // parts
    pieces = []
    for i in range(parts):
        bias = None if module.bias is None else module.bias[i * n:(i + 1) * n]
        if isinstance(module, QuantizedLinear):
            w = module.weight
            w = _rows_of(w, i * n, (i + 1) * n) if isinstance(w, QuantizedWeight) else w[i * n:(i + 1) * n]
            piece = QuantizedLinear(w, bias, act=module.act, act_range=module.act_range)
        else:
            piece = _linear(module.weight[i * n:(i + 1) * n], bias)
        pieces.append(piece)
    return pieces


def _norm(module: nn.Module, *, kind: str, eps: float | None = None) -> Norm:
    eps = eps if eps is not None else getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6))
    return Norm(module.weight, getattr(module, "bias", None), kind=kind, eps=eps)


def _embedding(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(module.weight.detach(), freeze=True, padding_idx=module.padding_idx)
    return module


def _refuse(arch: str, field: str, value: Any, fix: str) -> None:
    raise ValueError(f"{arch}: config.{field}={value!r} is not supported by init_inference; {fix}")


def _gpt2(model: nn.Module) -> Decoder:
    cfg, tr = model.config, model.transformer
    if cfg.scale_attn_by_inverse_layer_idx or cfg.reorder_and_upcast_attn or not cfg.scale_attn_weights:
        _refuse("gpt2", "scale_attn_*", "non-default", "use the default attention scaling")
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
    if cfg.activation_function not in act:
        _refuse("gpt2", "activation_function", cfg.activation_function, f"use one of {', '.join(act)}")
    d, heads = cfg.n_embd, cfg.n_head
    spec = DecoderSpec(arch="gpt2", vocab_size=cfg.vocab_size, hidden=d, head_dim=d // heads,
                       max_positions=cfg.n_positions, norm="layer", norm_eps=cfg.layer_norm_epsilon,
                       activation=act[cfg.activation_function])
    layers = []
    for block in tr.h:
        at, mlp = block.attn, block.mlp
        w, b = at.c_attn.weight.t(), at.c_attn.bias  # Conv1D stores (in, out)
        q, k, v = (_linear(w[i * d:(i + 1) * d], b[i * d:(i + 1) * d]) for i in range(3))
        layers.append(Layer(
            norm1=_norm(block.ln_1, kind="layer"), norm2=_norm(block.ln_2, kind="layer"), q=q, k=k, v=v,
            o=_linear(at.c_proj.weight.t(), at.c_proj.bias), up=_linear(mlp.c_fc.weight.t(), mlp.c_fc.bias),
            down=_linear(mlp.c_proj.weight.t(), mlp.c_proj.bias), gate=None, n_heads=heads, n_kv_heads=heads,
            head_dim=d // heads, activation=spec.activation))
    embed = _embedding(tr.wte)
    return Decoder(spec, embed=embed, pos=_embedding(tr.wpe), layers=layers,
                   norm_f=_norm(tr.ln_f, kind="layer"), head=_tied(model.lm_head, tr.wte, embed))


def _tied(head: nn.Module, source_embed: nn.Module, embed: nn.Module) -> nn.Module:
    """The head, sharing the decoder's embedding table when the source model tied them."""
    if isinstance(head, nn.Linear) and getattr(source_embed, "weight", None) is head.weight:
        lin = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        lin.weight = embed.weight
        if head.bias is not None:
            lin.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=False)
        return lin
    return _copy(head)


def _opt(model: nn.Module) -> Decoder:
    cfg, dec = model.config, model.model.decoder
    if not cfg.do_layer_norm_before:
        _refuse("opt", "do_layer_norm_before", False, "only pre-norm OPT models (all sizes but 350m) are supported")
    if cfg.word_embed_proj_dim != cfg.hidden_size:
        _refuse("opt", "word_embed_proj_dim", cfg.word_embed_proj_dim, "it must equal hidden_size")
    if cfg.activation_function not in ("relu", "gelu"):
        _refuse("opt", "activation_function", cfg.activation_function, "use relu or gelu")
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    spec = DecoderSpec(arch="opt", vocab_size=cfg.vocab_size, hidden=d, head_dim=d // heads,
                       max_positions=cfg.max_position_embeddings, norm="layer", norm_eps=1e-5, position_offset=2,
                       activation=cfg.activation_function, final_norm=dec.final_layer_norm is not None)
    layers = []
    for block in dec.layers:
        at = block.self_attn
        layers.append(Layer(
            norm1=_norm(block.self_attn_layer_norm, kind="layer"), norm2=_norm(block.final_layer_norm, kind="layer"),
            q=_copy(at.q_proj), k=_copy(at.k_proj), v=_copy(at.v_proj), o=_copy(at.out_proj), up=_copy(block.fc1),
            down=_copy(block.fc2), gate=None, n_heads=heads, n_kv_heads=heads, head_dim=d // heads,
            activation=spec.activation))
    embed = _embedding(dec.embed_tokens)
    norm_f = None if dec.final_layer_norm is None else _norm(dec.final_layer_norm, kind="layer")
    return Decoder(spec, embed=embed, pos=_embedding(dec.embed_positions), layers=layers, norm_f=norm_f,
                   head=_tied(model.lm_head, dec.embed_tokens, embed))


def _llama(model: nn.Module) -> Decoder:
    cfg, body = model.config, model.model
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 1e4)}
    if rope.get("rope_type", "default") != "default":
        _refuse("llama", "rope_parameters.rope_type", rope.get("rope_type"), "only the default rotary is supported")
    if cfg.hidden_act != "silu":
        _refuse("llama", "hidden_act", cfg.hidden_act, "use silu")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    spec = DecoderSpec(arch="llama", vocab_size=cfg.vocab_size, hidden=cfg.hidden_size, head_dim=head_dim,
                       max_positions=cfg.max_position_embeddings, norm="rms", norm_eps=cfg.rms_norm_eps,
                       position="rope", rope_theta=float(rope["rope_theta"]), activation="swiglu")
    layers = []
    for block in body.layers:
        at, mlp = block.self_attn, block.mlp
        layers.append(Layer(
            norm1=_norm(block.input_layernorm, kind="rms", eps=cfg.rms_norm_eps),
            norm2=_norm(block.post_attention_layernorm, kind="rms", eps=cfg.rms_norm_eps),
            q=_copy(at.q_proj), k=_copy(at.k_proj), v=_copy(at.v_proj), o=_copy(at.o_proj), up=_copy(mlp.up_proj),
            down=_copy(mlp.down_proj), gate=_copy(mlp.gate_proj), n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
            activation="swiglu"))
    embed = _embedding(body.embed_tokens)
    return Decoder(spec, embed=embed, pos=None, layers=layers, norm_f=_norm(body.norm, kind="rms", eps=cfg.rms_norm_eps),
                   head=_tied(model.lm_head, body.embed_tokens, embed))


def _is_example_gpt(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("tok", "pos", "blocks", "ln_f", "head")) and all(
        hasattr(b, "qkv") and hasattr(b, "n_heads") for b in model.blocks)


def _example_gpt(model: nn.Module) -> Decoder:
    d = model.tok.embedding_dim
    first = model.blocks[0]
    head_dim = first.qkv.weight.shape[0] // 3 // first.n_heads
    spec = DecoderSpec(arch="example-gpt", vocab_size=model.tok.num_embeddings, hidden=d, head_dim=head_dim,
                       max_positions=model.pos.num_embeddings, norm="layer", norm_eps=model.ln_f.eps, activation="gelu")
    layers = []
    for block in model.blocks:  # head counts and MLP widths per block: pruning may have changed them
        q, k, v = split_rows(block.qkv, 3)
        layers.append(Layer(
            norm1=_norm(block.ln1, kind="layer"), norm2=_norm(block.ln2, kind="layer"), q=q, k=k, v=v,
            o=_copy(block.proj), up=_copy(block.fc), down=_copy(block.out), gate=None, n_heads=block.n_heads,
            n_kv_heads=block.n_heads, head_dim=head_dim, activation="gelu"))
    embed = _embedding(model.tok)
    return Decoder(spec, embed=embed, pos=_embedding(model.pos), layers=layers, norm_f=_norm(model.ln_f, kind="layer"),
                   head=_tied(model.head, model.tok, embed))


_HF = {"gpt2": _gpt2, "opt": _opt, "llama": _llama}


def architecture(model: nn.Module) -> str:
    """The supported architecture name of `model`; ValueError naming what is supported otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _HF:
        return model_type
    if _is_example_gpt(getattr(model, "gpt", model)):
        return "example-gpt"
    name = model_type or type(model).__name__
    raise ValueError(f"init_inference: model architecture {name!r} is not supported; supported: {SUPPORTED}")


@torch.no_grad()
def to_decoder(model: nn.Module) -> Decoder:
    """The decoder running `model`'s weights (sharing their storage where the layout allows)."""
    arch = architecture(model)
    if arch == "example-gpt":
        return _example_gpt(getattr(model, "gpt", model))
    return _HF[arch](model)
