"""SparseSelfAttention / BertSparseSelfAttention against dense attention with the same masks (odd lengths
padded, both mask modes, rpe, causal layouts), SparseAttentionUtils on a Hugging Face BERT, and the
DeepSpeed import path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from deepfleet.engine.attention.sparse_self_attention import BertSparseSelfAttention, SparseSelfAttention
from deepfleet.engine.attention.sparsity_config import (
    BigBirdSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
)
from deepfleet.kernels.block_sparse_attention import expand_layout


def _dense(q, k, v, layout_mask, extra=None):
    additive = torch.zeros(layout_mask.shape).masked_fill(~layout_mask, float("-inf"))
    if extra is not None:
        additive = additive + extra
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


@pytest.mark.parametrize("length", [29, 32])
@pytest.mark.parametrize("kp_mode", ["add", "mul"])
def test_masks_rpe_and_padding_match_dense(length: int, kp_mode: str) -> None:
    random.seed(0)
    cfg = VariableSparsityConfig(2, block=8, num_random_blocks=1, local_window_blocks=[2], attention="bidirectional")
    attn = SparseSelfAttention(cfg, key_padding_mask_mode=kp_mode, attn_mask_mode="mul", max_seq_length=64)
    q, k, v = (torch.randn(2, 2, length, 6, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, length)
    keep[0, -3:] = 0  # sample 0's last 3 tokens are padding
    kpm = keep if kp_mode == "mul" else (1 - keep) * -1e4
    attn_mask = torch.ones(length, length)
    attn_mask[:, 4] = 0  # nobody attends to token 4
    rpe = torch.randn(2, length, length)
    out = attn(q, k, v, rpe=rpe, key_padding_mask=kpm, attn_mask=attn_mask)
    padded = -(-length // 8) * 8
    layout = expand_layout(attn.get_layout(padded), 8)[:, :length, :length]  # (H, L, L)
    extra = rpe[None] + torch.zeros(length, length).masked_fill(attn_mask == 0, float("-inf"))
    kp_add = torch.zeros(2, length).masked_fill(keep == 0, float("-inf")) if kp_mode == "mul" else kpm
    ref = _dense(q, k, v, layout[None].expand(2, -1, -1, -1), extra + kp_add[:, None, None, :])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_unidirectional_layout_is_causal_inside_blocks_and_accepts_a_transposed_key() -> None:
    cfg = FixedSparsityConfig(3, block=4, num_local_blocks=2, attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=24)
    q, k, v = (torch.randn(1, 3, 22, 5) for _ in range(3))
    out = attn(q, k.transpose(2, 3), v)
    mask = expand_layout(attn.get_layout(24), 4, causal=True)[:, :22, :22]
    torch.testing.assert_close(out, _dense(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert not SparseSelfAttention(cfg, max_seq_length=24, causal=False).causal


def test_module_checks_its_inputs() -> None:
    attn = SparseSelfAttention(DenseSparsityConfig(2, block=4), max_seq_length=16)
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="num_heads=2"):
        attn(torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4))
    with pytest.raises(ValueError, match="max_seq_length"):
        attn(*(torch.randn(1, 2, 20, 4) for _ in range(3)))
    with pytest.raises(NotImplementedError, match="self-attention"):
        attn(x, x, torch.randn(1, 2, 8, 3))
    with pytest.raises(ValueError, match="key_padding_mask_mode"):
        SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="xor")


class _BertConfig:
    hidden_size, num_attention_heads, max_position_embeddings = 12, 3, 64


def test_bert_sparse_self_attention_with_a_dense_layout_is_bert_attention() -> None:
    layer = BertSparseSelfAttention(_BertConfig(), DenseSparsityConfig(3, block=4))
    h = torch.randn(2, 10, 12)
    mask = torch.zeros(2, 1, 1, 10)
    mask[1, ..., 7:] = -10000.0  # HF's extended attention mask: sample 1 has 3 padding tokens
    out = layer(h, mask)
    q, k, v = (layer.transpose_for_scores(f(h)) for f in (layer.query, layer.key, layer.value))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(0, 2, 1, 3).reshape(2, 10, 12)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sparse_attention_utils_on_a_hugging_face_bert() -> None:
    transformers = pytest.importorskip("transformers")
    from deepfleet.engine.ops.sparse_attention import SparseAttentionUtils

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(5, 50, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 10:] = 0
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 32, DenseSparsityConfig(2, block=4))
    replaced = model.bert.encoder.layer[1].attention.self
    assert type(replaced).__name__ == "_HFSparseSelfAttention" and isinstance(replaced.inner, BertSparseSelfAttention)
    pad, ids_p, mask_p, types_p, _, _ = SparseAttentionUtils.pad_to_block_size(
        4, ids, mask, torch.zeros_like(ids), None, None, pad_token_id=0)
    assert pad == 3 and ids_p.shape == (2, 16) and mask_p[:, 13:].sum() == 0
    with torch.no_grad():
        after = model(input_ids=ids_p, attention_mask=mask_p, token_type_ids=types_p).logits
    after = SparseAttentionUtils.unpad_sequence_output(pad, after)
    torch.testing.assert_close(after[0], before[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after[1, :10], before[1, :10], atol=1e-4, rtol=1e-4)
    SparseAttentionUtils.extend_position_embedding(model, 64)
    assert model.bert.embeddings.position_embeddings.weight.shape == (64, 16)
    assert model.config.max_position_embeddings == 64


def test_deepspeed_import_path_names() -> None:
    import deepfleet.engine.ops.sparse_attention as sa

    for name in ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
                 "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
                 "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils"):
        assert hasattr(sa, name), name
    assert sa.BigBirdSparsityConfig is BigBirdSparsityConfig


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_mask_path_matches_the_kernel_forward(causal: bool) -> None:
    # flex_attention has no backward on CPU: its GPU fast path is checked forward, under no_grad.
    from deepfleet.engine.attention.flex import flex_block_sparse_attention
    from deepfleet.kernels.block_sparse_attention import block_sparse_attention, layout_blocks

    random.seed(2)
    layout = BigBirdSparsityConfig(2, block=16, different_layout_per_head=True).make_layout(96)
    q, k, v = (torch.randn(1, 2, 96, 8) for _ in range(3))
    rows, cols = layout_blocks(layout)
    with torch.no_grad():
        out = flex_block_sparse_attention(q, k, v, layout, block=16, causal=causal)
        ref = block_sparse_attention(q, k, v, rows, cols, block=16, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
