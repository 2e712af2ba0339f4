"""Small models with the module names real compression configs target (shared by these tests).

`TinyBert` mirrors Hugging Face BERT's module tree (`bert.encoder.layer.N.attention.self.query`,
`attention.output.dense`, `intermediate.dense`, `output.dense`, `bert.pooler`, `classifier`), whose
names the DeepSpeed BERT compression configs use; its attention reads its head count and widths
from its projections, so a head-pruned model still runs. `bert_config` and `gpt2_w8a8_config` are the
two real-world `compression_training` shapes (BERT layer reduction + pruning; GPT-2 W8A8 groups).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_attention_heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.self = SelfAttention(d, heads)
        self.output = Dense(d, d)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attention = Attention(d, heads)
        self.intermediate = Dense(d, 4 * d)
        self.output = Dense(4 * d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attention.output.dense(self.attention.self(x)))
        return self.ln2(x + self.output.dense(F.gelu(self.intermediate.dense(x))))


class Encoder(nn.Module):
    def __init__(self, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(d, heads) for _ in range(layers))


class Bert(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.encoder = Encoder(d, heads, layers)
        self.pooler = Dense(d, d)


class TinyBert(nn.Module):
    """Token ids (batch, seq) -> class logits (batch, classes)."""

    def __init__(self, *, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.bert = Bert(vocab, d, heads, layers)
        self.classifier = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.bert.embeddings(ids)
        for layer in self.bert.encoder.layer:
            x = layer(x)
        return self.classifier(torch.tanh(self.bert.pooler.dense(x[:, 0])))


class BertWithLoss(nn.Module):
    def __init__(self, **kwargs: int) -> None:
        super().__init__()
        self.model = TinyBert(**kwargs)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.model(batch["input_ids"]), batch["labels"])


def bert_batches(n: int, *, batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids[:, 0] % 3})
    return out


def bert_config(*, offset: int = 2, layer_reduction: bool = True) -> dict:
    """DeepSpeed's BERT compression shape: layer reduction, sparse / row / head pruning with related modules."""
    return {
        "layer_reduction": {
            "enabled": layer_reduction,
            "keep_number_layer": 2,
            "module_name_prefix": "model.bert.encoder.layer",
            "teacher_layer": [1, 3],
            "other_module_name": ["model.bert.pooler", "model.bert.embeddings", "model.classifier"],
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": offset, "method": "l1"},
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}},
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": offset, "method": "topk"},
            "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                         "related_modules": [["layer.\\w+.output.dense"]]}},
        },
        "head_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": offset, "method": "topk", "num_heads": 4},
            "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                                         "related_modules": [["self.query", "self.key", "self.value"]]}},
        },
    }


def gpt2_w8a8_config(*, offset: int = 0) -> dict:
    """DeepSpeed's GPT-2 W8A8 shape: grouped symmetric weight quantization in forward, dynamic
    8-bit activations, the flat `fp16_mixed_quantize: false` form some configs carry."""
    return {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True, "quantizer_kernel": False, "schedule_offset": offset, "quantize_groups": 64,
                "quantize_verbose": False, "quantization_type": "symmetric", "quantize_weight_in_forward": True,
                "rounding": "nearest", "fp16_mixed_quantize": False, "quantize_change_ratio": 0.001,
            },
            "different_groups": {
                "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                        "modules": ["qkv", "proj"]},
                "wq2": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                        "modules": ["fc", "out"]},
            },
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "quantization_type": "symmetric",
                                  "range_calibration": "dynamic", "schedule_offset": offset},
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["blocks"]}},
        },
    }
