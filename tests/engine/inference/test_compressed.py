"""A model cleaned by engine/compression's `redundancy_clean` (pruned heads and rows, int8/int4 codes,
W8A8 activation quantization) loads and runs through init_inference: the same logits and greedy
tokens as the cleaned model itself, with its integer codes kept as they are."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine import init_inference
from deepfleet.engine.compression.compress import init_compression, redundancy_clean
from deepfleet.engine.compression.generate import greedy_generate
from deepfleet.engine.compression.quantized import QuantizedLinear, QuantizedWeight
from deepfleet.engine.compression.scheduler import CompressionScheduler
from tests.engine.compression.models import gpt2_w8a8_config
from tests.engine.compression.test_export import _gpt, _structured


def _cleaned(cfg: dict):
    model = _gpt()
    init_compression(model, cfg)
    CompressionScheduler(model)
    return redundancy_clean(model, cfg).eval()


@pytest.mark.parametrize("case", ["pruned", "pruned-int8", "pruned-int4", "w8a8"])
def test_cleaned_model_runs_through_init_inference(case):
    cfg = {"compression_training": gpt2_w8a8_config()} if case == "w8a8" else _structured(
        {"pruned": None, "pruned-int8": 8, "pruned-int4": 4}[case])
    model = _cleaned(cfg)
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=16)
    layer = engine.module.layers[0]
    if case.startswith("pruned"):
        assert layer.q.weight.shape[0] == 16 and layer.up.weight.shape[0] == 32  # 2 of 4 heads, 32 of 128 units
    if case in ("pruned-int8", "pruned-int4"):
        assert isinstance(layer.q, QuantizedLinear) and isinstance(layer.q.weight, QuantizedWeight)
        source = model.blocks[0].qkv.weight.codes
        assert torch.equal(layer.q.weight.codes, source[:source.shape[0] // 3])  # codes kept bit for bit
    torch.testing.assert_close(engine(ids), expected, atol=2e-5, rtol=1e-5)
    ref = greedy_generate(model, ids[:, :4], max_new_tokens=6, max_context=16)
    assert torch.equal(engine.generate(ids[:, :4], max_new_tokens=6), ref)
