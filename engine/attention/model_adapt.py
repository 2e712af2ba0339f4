"""DeepSpeed's `SparseAttentionUtils`: fit a pretrained model to sparse attention and longer sequences.

Callers: user scripts (through `deepfleet.engine.ops.sparse_attention`). Same static methods, arguments
and return values as DeepSpeed's: extend BERT/RoBERTa position embeddings by repetition, raise a
tokenizer's `model_max_length`, replace every self-attention of a Hugging Face BERT/RoBERTa encoder with
`BertSparseSelfAttention` (keeping the trained query/key/value projections), pad a batch to a multiple
of the block size and cut the padding off the output.

One adaptation: Hugging Face's attention layers call `self.self(hidden_states, attention_mask=...,
**kwargs)` and unpack `(output, attention_weights)`, with a 4-D mask (boolean "attend" or additive), so
the replacement is wrapped in `_HFSparseSelfAttention`, which takes that call, turns the mask into the
key padding mask DeepSpeed's layer expects, and returns `(context, None)`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepfleet.engine.attention.sparse_self_attention import BertSparseSelfAttention
from deepfleet.engine.attention.sparsity_config import SparsityConfig

log = logging.getLogger(__name__)


class _HFSparseSelfAttention(nn.Module):
    """Hugging Face's self-attention call convention around a `BertSparseSelfAttention`."""

    def __init__(self, inner: BertSparseSelfAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs):
        key_padding = None
        if attention_mask is not None:
            m = attention_mask
            while m.dim() > 2:  # (B, 1, Lq, Lk) or (B, 1, 1, Lk): every query row has the same key mask
                m = m[:, 0]
            if m.dtype == torch.bool:
                key_padding = torch.zeros(m.shape, device=m.device).masked_fill(~m, float("-inf"))
            else:
                key_padding = m.float()
        return self.inner(hidden_states, key_padding), None


class SparseAttentionUtils:
    """Helpers to put sparse self-attention into a pretrained transformer (DeepSpeed's names)."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Repeat a BERT/RoBERTa model's position embeddings to cover `max_position` positions."""
        if hasattr(model, "bert"):
            emb = model.bert.embeddings.position_embeddings
            original = emb.weight.size(0)
            if max_position <= original:
                raise ValueError(f"max_position {max_position} must exceed the current {original}")
            times = max(1, max_position // original)
            emb.weight.data = emb.weight.data.repeat(times, 1)
            emb.num_embeddings = emb.weight.size(0)
        elif hasattr(model, "roberta"):
            emb = model.roberta.embeddings.position_embeddings
            original, width = emb.weight.shape
            original -= 2  # RoBERTa reserves positions 0 and 1
            if max_position <= original:
                raise ValueError(f"max_position {max_position} must exceed the current {original}")
            times = max(1, max_position // original)
            max_position += 2
            grown = emb.weight.data.new_empty(max_position, width)
            grown[:2] = emb.weight.data[:2]
            for i in range(times):
                grown[2 + i * original: 2 + (i + 1) * original] = emb.weight.data[2:]
            emb.weight.data = grown
            emb.num_embeddings = max_position
        else:
            raise ValueError("extend_position_embedding supports models with a .bert or .roberta attribute")
        model.config.max_position_embeddings = max_position
        log.info("Extended position embeddings to %d", original * times)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position: int):
        """Set the tokenizer's model_max_length (and its init kwargs) to `max_position`."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: nn.Module, max_position: int, sparsity_config: SparsityConfig | None = None
    ) -> nn.Module:
        """Replace every encoder self-attention of a BERT/RoBERTa model with sparse self-attention."""
        if hasattr(model, "bert"):
            model.config.max_position_embeddings = max_position
            layers = model.bert.encoder.layer
        elif hasattr(model, "roberta"):
            model.config.max_position_embeddings = max_position + 2
            layers = model.roberta.encoder.layer
        else:
            raise ValueError("replace_model_self_attention_with_sparse_self_attention supports .bert or .roberta models")
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, layers, sparsity_config
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config, layers, sparsity_config: SparsityConfig | None = None
    ):
        """In each layer, `layer.attention.self` becomes sparse attention sharing its query/key/value."""
        for layer in layers:
            sparse = BertSparseSelfAttention(config, sparsity_config)
            old = layer.attention.self
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            layer.attention.self = _HFSparseSelfAttention(sparse)
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: Tensor | None, attention_mask: Tensor | None,
                          token_type_ids: Tensor | None, position_ids: Tensor | None, inputs_embeds: Tensor | None,
                          pad_token_id: int, model_embeddings=None):
        """Pad the sequence dimension to a multiple of `block_size`; returns (pad_len, input_ids,
        attention_mask, token_type_ids, position_ids, inputs_embeds), padding masked out."""
        batch, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len:
            if inputs_embeds is not None:
                ids = inputs_embeds.new_full((batch, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: Tensor) -> Tensor:
        """Drop the `pad_len` padded positions from (batch, L, ...) encoder output."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
