"""The decoder's fast forms against their plain twins, over odd shapes: packed-prefill attention and
one-query decode attention against SDPA with an explicit mask, per prompt; `MatmulLinear` against the
nn.Linear it was made from, and where kernel injection uses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepfleet.engine.inference.attention import Packed, decode_attention, masked_attention, packed_attention
from deepfleet.engine.inference.decoder import MatmulLinear

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "span"), [(4, 4, 16, 64), (6, 2, 8, 13), (1, 1, 32, 1)])
def test_decode_attention_equals_masked_sdpa(dtype, heads, kv_heads, head_dim, span):
    g = torch.Generator().manual_seed(0)
    batch = 5
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, span, head_dim, generator=g).to(dtype) for _ in range(2))
    positions = torch.randint(0, span, (batch, 1), generator=g)
    visible = torch.arange(span)[None, None, None, :] <= positions[:, None, :, None]
    ref = masked_attention(q, keys, values, visible)
    out = decode_attention(q, keys, values, positions)
    assert out.shape == ref.shape == (batch, 1, heads * head_dim) and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(("lengths", "slots", "kv_heads"), [([5, 1, 7], [3, 0, 5], 2), ([4], [0], 4),
                                                           ([2, 2, 3, 1], [0, 1, 2, 3], 1)])
def test_packed_prefill_attention_equals_each_prompt_alone(lengths, slots, kv_heads):
    g = torch.Generator().manual_seed(1)
    heads, head_dim, max_tokens = 4, 8, 12
    ck, cv = (torch.randn(6, kv_heads, max_tokens, head_dim, generator=g) for _ in range(2))  # stale contents
    packed = Packed.of(lengths, slots, device=torch.device("cpu"))
    tokens = sum(lengths)
    q = torch.randn(1, tokens, heads, head_dim, generator=g)
    k, v = (torch.randn(1, tokens, kv_heads, head_dim, generator=g) for _ in range(2))
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    ck[packed.token_slots, :, positions] = k
    cv[packed.token_slots, :, positions] = v
    out = packed_attention(q, ck, cv, packed)
    assert out.shape == (1, tokens, heads * head_dim)
    start = 0
    for i, n in enumerate(lengths):  # each prompt alone, causal over its own keys
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        ref = masked_attention(q[:, start:start + n], k[:, start:start + n].transpose(1, 2),
                               v[:, start:start + n].transpose(1, 2), causal)
        torch.testing.assert_close(out[:, start:start + n], ref, atol=2e-6, rtol=2e-6)
        assert int(packed.last[i]) == start + n - 1
        start += n


@pytest.mark.parametrize(("d_in", "d_out", "bias", "lead"), [(7, 5, True, (3,)), (256, 768, False, (16, 1)),
                                                             (33, 1, True, (2, 9)), (64, 97, False, ())])
def test_matmul_linear_equals_its_nn_linear(d_in, d_out, bias, lead):
    torch.manual_seed(2)
    linear = nn.Linear(d_in, d_out, bias=bias)
    fast = MatmulLinear(linear)
    x = torch.randn(*lead, d_in)
    assert fast.weight_t.is_contiguous() and torch.equal(fast.weight, linear.weight)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), linear(x), atol=1e-5, rtol=1e-5)
    assert fast(x).shape == (*lead, d_out)


def test_kernel_inject_leaves_a_head_tied_to_the_embedding_as_it_is():
    pytest.importorskip("transformers")
    from deepfleet.engine import init_inference
    from tests.engine.inference.models import hf_model, prompts

    model = hf_model("gpt2")  # GPT-2 ties its head to the token embedding
    fused = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert type(fused.module.head) is nn.Linear and fused.module.head.weight is fused.module.embed.weight
    assert type(fused.module.layers[0].o) is MatmulLinear
    ids = torch.tensor(prompts(2, low=5, high=6))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(ids, max_new_tokens=6, pad_token_id=0), ref)


def test_the_transposed_layout_is_kept_off_past_its_weight_budget():
    pytest.importorskip("transformers")
    from deepfleet.engine import init_inference
    from tests.engine.inference.models import hf_model

    engine = init_inference(hf_model("llama"), dtype=torch.float32)  # plain: the projections stay nn.Linear
    engine.module.use_fused_kernels(True)
    engine.module.use_matmul_layout(True, max_bytes=1024)  # far below the tiny model's weights
    assert type(engine.module.layers[0].qkv) is nn.Linear and type(engine.module.head) is nn.Linear
    engine.module.use_matmul_layout(True)
    assert type(engine.module.layers[0].qkv) is MatmulLinear and type(engine.module.head) is MatmulLinear
