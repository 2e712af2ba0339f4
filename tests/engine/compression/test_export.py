"""redundancy_clean: a smaller plain model computing what the trained compressed model computed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepfleet.engine.compression.compress import init_compression, redundancy_clean, student_initialization
from deepfleet.engine.compression.export import model_bytes
from deepfleet.engine.compression.generate import greedy_generate
from deepfleet.engine.compression.layers import CompressedMixin
from deepfleet.engine.compression.quantized import QuantizedEmbedding, QuantizedLinear
from deepfleet.engine.compression.quantizers import fake_quantize
from deepfleet.engine.compression.scheduler import CompressionScheduler
from examples.gpt.model import GPTConfig, TinyGPT
from tests.engine.compression.models import TinyBert, bert_config, gpt2_w8a8_config


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2))


def _structured(bits: int | None) -> dict:
    cfg = {
        "head_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 0, "num_heads": 4, "method": "l1"},
                         "different_groups": {"h": {"params": {"dense_ratio": 0.5}, "modules": ["proj"],
                                                    "related_modules": [["qkv"]]}}},
        "row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 0},
                        "different_groups": {"r": {"params": {"dense_ratio": 0.25}, "modules": ["fc"],
                                                   "related_modules": [["blocks\\.\\d+\\.out"]]}}},
    }
    if bits:
        cfg["weight_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 8},
            "different_groups": {"w": {"params": {"start_bits": bits, "target_bits": bits}, "modules": ["blocks"]}}}
    return {"compression_training": cfg}


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_pruned_and_quantized_gpt_shrinks_and_computes_the_same(bits: int | None) -> None:
    model, cfg = _gpt(), _structured(bits)
    init_compression(model, cfg)
    CompressionScheduler(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        expected = model(ids)
    generated = greedy_generate(model, ids[:, :4], max_new_tokens=5, max_context=16)
    before, params_before = model_bytes(model), sum(p.numel() for p in model.parameters())
    redundancy_clean(model, cfg)
    assert not any(isinstance(m, CompressedMixin) for m in model.modules())
    block = model.blocks[0]
    assert block.n_heads == 2 and block.proj.in_features == 16 and block.fc.out_features == 32
    assert block.out.in_features == 32
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=2e-5)
    assert sum(p.numel() for p in model.parameters()) < params_before
    assert model_bytes(model) < before
    if bits:
        assert isinstance(block.qkv, QuantizedLinear) and block.qkv.weight.codes.dtype in (torch.int8, torch.uint8)
        if bits == 4:
            assert block.qkv.weight.codes.shape[1] == block.qkv.in_features // 2  # two codes per byte
    assert generated.shape == (2, 9)
    assert torch.equal(greedy_generate(model, ids[:, :4], max_new_tokens=5, max_context=16), generated)


def test_w8a8_export_stores_int8_with_scales_and_keeps_activation_quantization() -> None:
    model, cfg = _gpt(), {"compression_training": gpt2_w8a8_config()}
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_groups"] = 32
    init_compression(model, cfg)
    CompressionScheduler(model)
    ids = torch.randint(0, 64, (2, 16))
    model.eval()
    with torch.no_grad():
        expected = model(ids)
    w = model.blocks[0].qkv.weight.detach().clone()
    redundancy_clean(model, cfg)
    qkv = model.blocks[0].qkv
    assert qkv.act is not None and qkv.act["bits"] == 8
    torch.testing.assert_close(qkv.weight.dequantize(), fake_quantize(w, 8, groups=32), rtol=0, atol=1e-6)
    assert qkv.weight.storage_bytes() < w.numel() * 4 / 3
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=2e-5)


def test_embedding_quantization_is_per_token() -> None:
    model = _gpt()
    cfg = {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["^tok$"]}}}}}
    init_compression(model, cfg)
    CompressionScheduler(model)
    w = model.tok.weight.detach().clone()
    redundancy_clean(model, cfg)
    assert isinstance(model.tok, QuantizedEmbedding)
    torch.testing.assert_close(model.tok.weight.dequantize(), fake_quantize(w, 8, groups=64), rtol=0, atol=1e-6)


def test_two_four_sparse_export_keeps_half_the_weights() -> None:
    model = _gpt()
    cfg = {"compression_training": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "block_pattern": "2:4"},
        "different_groups": {"s": {"params": {"dense_ratio": 0.5}, "modules": ["blocks"]}}}}}
    init_compression(model, cfg)
    CompressionScheduler(model)
    model(torch.randint(0, 64, (1, 8)))
    redundancy_clean(model, cfg)
    w = model.blocks[1].fc.weight
    assert type(model.blocks[1].fc) is nn.Linear
    assert torch.all((w.reshape(w.shape[0], -1, 4) != 0).sum(-1) <= 2)


def test_bert_layer_reduction_then_head_and_row_pruning_clean() -> None:
    torch.manual_seed(0)
    teacher = nn.Module()
    teacher.model = TinyBert(layers=4)
    student = nn.Module()
    student.model = TinyBert(layers=2)
    cfg = {"compression_training": bert_config(offset=0)}
    init_compression(student, cfg, teacher_model=teacher)
    s_layers, t_layers = student.model.bert.encoder.layer, teacher.model.bert.encoder.layer
    torch.testing.assert_close(s_layers[0].intermediate.dense.weight, t_layers[1].intermediate.dense.weight)
    torch.testing.assert_close(s_layers[1].ln1.weight, t_layers[3].ln1.weight)
    torch.testing.assert_close(student.model.classifier.weight, teacher.model.classifier.weight)
    CompressionScheduler(student)
    ids = torch.randint(0, 64, (3, 8))
    student.eval()
    with torch.no_grad():
        expected = student.model(ids)
    redundancy_clean(student, cfg)
    att = student.model.bert.encoder.layer[0].attention
    assert att.self.num_attention_heads == 2 and att.self.query.out_features == 16
    assert att.output.dense.in_features == 16
    assert student.model.bert.encoder.layer[0].intermediate.dense.out_features == 64
    with torch.no_grad():
        torch.testing.assert_close(student.model(ids), expected, rtol=0, atol=2e-5)


def test_layer_reduction_errors_name_the_problem() -> None:
    cfg = {"compression_training": bert_config()}
    student = nn.Module()
    student.model = TinyBert(layers=2)
    with pytest.raises(ValueError, match="teacher_model"):
        init_compression(student, cfg)
    wrong = nn.Module()
    wrong.model = TinyBert(layers=4, d=16)
    with pytest.raises(ValueError, match="differ in shape"):
        student_initialization(student, wrong, cfg)
