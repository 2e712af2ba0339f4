"""Tiny causal LMs for the inference tests: Hugging Face GPT-2, Llama and OPT built from configs, and
the example GPT. Weights are drawn with a wide init (std 0.3) so greedy decoding does not collapse into
one repeated token, which would make "token-identical" a weak check."""

from __future__ import annotations

import torch
from torch import nn

from examples.gpt.model import GPTConfig, TinyGPT

VOCAB = 97
HF_ARCHS = ("gpt2", "llama", "opt")


def hf_model(arch: str, *, seed: int = 0, layers: int = 2, init_std: float = 0.3) -> nn.Module:
    """A 2-layer, 32-wide model of `arch` (4 heads; Llama with 2 kv heads), in eval mode."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )

    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=layers, n_head=4,
                         initializer_range=init_std, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          initializer_range=init_std, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    elif arch == "opt":
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=4,
                        max_position_embeddings=128, word_embed_proj_dim=32, init_std=init_std)
        model = OPTForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def example_gpt(*, seed: int = 0, wide: bool = True, d_model: int = 32) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=64, d_model=d_model, n_heads=4, n_layers=2))
    with torch.no_grad():
        if not wide:
            return model.eval()
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


def prompts(n: int, *, seed: int = 1, low: int = 3, high: int = 9) -> list[list[int]]:
    """`n` prompts of lengths in [low, high), token ids clear of the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (t,), generator=g).tolist() for t in lengths]


def left_padded(rows: list[list[int]], *, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with every row right-aligned, as tokenizers pad for generation."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def trained(model: nn.Module, *, steps: int = 80, seq: int = 24, seed: int = 0) -> nn.Module:
    """`model` after `steps` AdamW steps on the example's synthetic counting sequences: a model with the
    confident next-token margins of a trained one, which quantization error is judged against."""
    import torch.nn.functional as F

    from examples.gpt.model import SyntheticTokens

    torch.manual_seed(seed)
    data = SyntheticTokens(num_samples=1024, seq_len=seq, vocab_size=VOCAB, seed=seed).tokens
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (32,))]
        out = model(batch[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model.eval()


def held_out(n: int = 32, *, seq: int = 24) -> torch.Tensor:
    """A fixed prompt set from the same distribution as `trained`'s data, not seen in training."""
    from examples.gpt.model import SyntheticTokens

    return SyntheticTokens(num_samples=n, seq_len=seq, vocab_size=VOCAB, seed=99).tokens[:, :seq]
