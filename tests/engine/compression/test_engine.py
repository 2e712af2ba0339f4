"""Compression through the engine: real-world configs train via initialize, every ZeRO stage agrees,
and a QAT + pruning run under ZeRO-3 on 2 gloo ranks resumes exactly from a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.engine.compression.models import BertWithLoss, bert_batches, bert_config, gpt2_w8a8_config
from tests.spawn import spawn

K, N = 3, 3  # steps before the save, steps compared after it


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _gpt(d_model: int = 32):
    from examples.gpt.model import GPTConfig, GPTWithLoss

    torch.manual_seed(0)
    return GPTWithLoss(GPTConfig(vocab_size=64, seq_len=16, d_model=d_model, n_heads=2, n_layers=2))


def _train(engine, batches: list[dict]) -> list[float]:
    losses = []
    for batch in batches:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _config(compression: dict, *, stage: int = 0, micro: int = 4) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "compression_training": compression,
    }


def _gpt_batches(n: int, *, batch: int = 4, rank: int = 0, world: int = 1) -> list[dict]:
    from examples.gpt.model import SyntheticTokens

    data = SyntheticTokens(num_samples=n * batch * world, seq_len=16, vocab_size=64, seed=3)
    out = []
    for i in range(n):
        rows = [data[(i * world + rank) * batch + j] for j in range(batch)]
        out.append({k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    return out


def test_gpt2_w8a8_config_trains_through_initialize() -> None:
    import deepfleet.engine as deepfleet
    from deepfleet.engine.compression.layers import CompressedLinear

    engine, *_ = deepfleet.initialize(model=_gpt(), config=_config(gpt2_w8a8_config()))
    assert isinstance(engine.module.gpt.blocks[0].qkv, CompressedLinear)
    assert engine.module.gpt.blocks[0].qkv.active("activation_quantization")
    batch = _gpt_batches(1)[0]
    losses = _train(engine, [batch] * 8)
    assert losses[-1] < losses[0]


def test_bert_layer_reduction_and_pruning_config_trains() -> None:
    import deepfleet.engine as deepfleet
    from deepfleet.engine.compression.compress import init_compression

    torch.manual_seed(0)
    teacher, student = BertWithLoss(layers=4), BertWithLoss(layers=2)
    cfg = _config(bert_config(offset=2))
    with pytest.raises(ValueError, match="teacher_model"):
        deepfleet.initialize(model=BertWithLoss(layers=2), config=cfg)
    init_compression(student, cfg, teacher_model=teacher)
    engine, *_ = deepfleet.initialize(model=student, config=cfg)
    dense = student.model.bert.encoder.layer[0].attention.output.dense
    assert dense.step == 0 and not dense.active("head_pruning")
    batch = bert_batches(1)[0]
    losses = _train(engine, [batch] * 10)
    assert dense.step == 10 and dense.active("head_pruning")
    assert all(torch.isfinite(torch.tensor(losses))) and min(losses[5:]) < losses[2]


def test_bf16_training_keeps_the_ramp_and_masks_exact() -> None:
    import deepfleet.engine as deepfleet

    compression = {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "schedule_offset_end": 5,
                              "schedule_offset_stride": 1},
        "different_groups": {"s": {"params": {"dense_ratio": 0.4}, "modules": ["fc"]}}}}
    engine, *_ = deepfleet.initialize(model=_gpt(), config={**_config(compression), "bf16": {"enabled": True}})
    fc = engine.module.gpt.blocks[0].fc
    losses = _train(engine, _gpt_batches(6))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert int(fc.cq_sparse_ppm) == 400_000  # 0.4 exactly, whatever the model's dtype
    assert int(fc.cq_sparse_mask.float().sum()) == math.ceil(0.4 * fc.weight.numel())


# --------------------------------------------------------------------------- multi-rank

QAT = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 1, "quantize_groups": 4},
        "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 1},
                                   "modules": ["blocks"]}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["fc", "out"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 2, "schedule_offset_end": 4},
        "different_groups": {"s": {"params": {"dense_ratio": 0.5}, "modules": ["qkv", "proj"]}}},
}


def _stages(rank: int, world: int) -> dict[int, list[float]]:
    import deepfleet.engine as deepfleet

    out = {}
    for stage in range(4):
        engine, *_ = deepfleet.initialize(model=_gpt(), config=_config(QAT, stage=stage, micro=2))
        out[stage] = _train(engine, _gpt_batches(5, batch=2, rank=rank, world=world))
    return out


@pytest.mark.slow
def test_every_zero_stage_trains_the_same_compressed_model() -> None:
    losses = spawn(_stages, 2, timeout=240)[0]
    for stage in (1, 2, 3):
        assert losses[stage] == pytest.approx(losses[0], rel=1e-5, abs=1e-5), stage


def _qat_run(rank: int, world: int, root: str, resume: bool) -> list[float]:
    import deepfleet.engine as deepfleet

    engine, *_ = deepfleet.initialize(model=_gpt(), config=_config(QAT, stage=3, micro=2))
    batches = _gpt_batches(K + N, batch=2, rank=rank, world=world)
    if resume:
        engine.load_checkpoint(root)
        assert engine.global_steps == K and engine.compression.training_steps == K
        return _train(engine, batches[K:])
    _train(engine, batches[:K])
    engine.save_checkpoint(root)
    return _train(engine, batches[K:])


@pytest.mark.slow  # two 2-rank spawns: ~40 s on an idle 2-core box, minutes on a busy one
def test_qat_under_zero3_resumes_exactly(tmp_path) -> None:
    uninterrupted = spawn(_qat_run, 2, str(tmp_path), False, timeout=240)[0]
    resumed = spawn(_qat_run, 2, str(tmp_path), True, timeout=240)[0]
    assert resumed == pytest.approx(uninterrupted, abs=1e-6)
