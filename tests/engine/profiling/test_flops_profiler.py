"""The FLOPs profiler: a known GPT's training FLOPs equal the analytical count (6 N tokens plus causal
attention) within 2%, causal and masked attention count only the pairs computed, `get_model_profile`
returns DeepSpeed's (flops, macs, params) and writes its report, and the engine's MFU on a causal model
stays in (0, 1]."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from deepfleet.engine.profiling.attention_flops import causal_pairs
from deepfleet.engine.profiling.counter import FlopCount
from deepfleet.engine.profiling.flops_profiler import get_model_profile
from deepfleet.engine.profiling.peaks import PEAK_ENV, cpu_peak_flops, peak_flops
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens, TinyGPT

CFG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2)


def analytical_training_flops(cfg: GPTConfig, *, batch: int) -> float:
    """6 N T for the matmul weights (N = non-embedding parameters) plus causal attention: per layer and
    sequence, Q K^T and P V over the L(L+1)/2 kept pairs, 2 * d_model FLOPs each, forward; x3 with backward."""
    model = TinyGPT(cfg)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok.", "pos.")))
    tokens = batch * cfg.seq_len
    attention = 3 * cfg.n_layers * batch * 2 * (2 * cfg.d_model) * causal_pairs(cfg.seq_len, cfg.seq_len)
    return 6 * n * tokens + attention


def test_gpt_training_flops_equal_the_analytical_count() -> None:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len))
    counts = FlopCount(model)
    with counts.count("forward"):
        logits = model(idx)
    with counts.count("backward"):
        logits.float().sum().backward()
    expected = analytical_training_flops(CFG, batch=3)
    assert counts.total == pytest.approx(expected, rel=0.02)
    assert counts.by_phase["backward"] == pytest.approx(2 * counts.by_phase["forward"], rel=0.02)
    # torch's own table has no entry for the CPU attention kernel: its count misses the attention term
    with FlopCounterMode(display=False) as plain:
        model(idx).float().sum().backward()
    assert plain.get_total_flops() < counts.total


def test_causal_attention_counts_the_lower_triangle() -> None:
    q = torch.randn(2, 3, 10, 8, requires_grad=True)
    k = torch.randn(2, 3, 12, 8, requires_grad=True)
    v = torch.randn(2, 3, 12, 4, requires_grad=True)

    def fwd_bwd(**kw) -> tuple[int, int]:
        c = FlopCount()
        with c.count("forward"):
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        with c.count("backward"):
            out.sum().backward()
        return c.by_phase["forward"], c.by_phase["backward"]

    full, causal = fwd_bwd(), fwd_bwd(is_causal=True)
    tril = torch.ones(10, 12, dtype=torch.bool).tril()
    per_pair = 2 * (8 + 4)
    assert full == (2 * 3 * 10 * 12 * per_pair, 2 * 2 * 3 * 10 * 12 * per_pair)
    assert causal[0] == 2 * 3 * int(tril.sum()) * per_pair and causal[1] == 2 * causal[0]
    assert fwd_bwd(attn_mask=tril) == causal  # an explicit boolean mask counts the same pairs
    additive = torch.zeros(10, 12).masked_fill(~tril, float("-inf"))
    assert fwd_bwd(attn_mask=additive) == causal
    assert causal_pairs(4, 4) == 10 and causal_pairs(6, 4) == 10 + 2 * 4 and causal_pairs(3, 5) == 6


def test_get_model_profile_returns_flops_macs_params_and_writes_the_report(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    flops, macs, params = get_model_profile(model, input_shape=(4, 16), print_profile=False, as_string=False)
    assert flops == 2 * 4 * (16 * 32 + 32 * 8) and macs == flops // 2
    assert params == sum(p.numel() for p in model.parameters())
    strings = get_model_profile(model, input_shape=(4, 16), print_profile=False)
    assert strings == ("6.14 K", "3.07 KMACs", "808.00")
    ignored = get_model_profile(model, args=[torch.ones(4, 16)], print_profile=False, as_string=False,
                                ignore_modules=[nn.Linear])
    assert ignored[0] == 0
    report = tmp_path / "profile.txt"
    gpt = TinyGPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    fwd, _, _ = get_model_profile(gpt, args=[idx], output_file=str(report), module_depth=2, top_modules=2,
                                  as_string=False)
    assert fwd == pytest.approx(analytical_training_flops(CFG, batch=2) / 3, rel=0.02)
    text = report.read_text()
    assert "fwd MACs" in text and "blocks.0 Block" in text and "blocks.0.qkv" not in text  # depth 2 only


def test_get_model_profile_names_bad_arguments() -> None:
    with pytest.raises(ValueError, match="args: give input_shape"):
        get_model_profile(nn.Linear(2, 2), print_profile=False)
    with pytest.raises(ValueError, match="mode: 'train'"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), mode="train")


def test_cpu_peak_comes_from_the_advertised_vector_width(monkeypatch) -> None:
    info = "processor\t: 0\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu sse avx2 fma\n"
    assert cpu_peak_flops(2, cpuinfo=info) == 2 * 2.0e9 * 32
    assert cpu_peak_flops(1, cpuinfo=info.replace("avx2", "avx512f avx2")) == 2.0e9 * 64
    assert cpu_peak_flops(1, cpuinfo="cpu MHz : 1000\nflags : sse2\n") == 1.0e9 * 8
    monkeypatch.setenv(PEAK_ENV, "1e12")
    assert peak_flops(torch.device("cpu"), torch.float32) == 1e12
    monkeypatch.setenv(PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=PEAK_ENV):
        peak_flops(torch.device("cpu"), torch.float32)


def test_engine_mfu_on_causal_attention_stays_at_most_one(tmp_path) -> None:
    import deepfleet.engine as deepspeed

    torch.manual_seed(0)
    # attention-heavy: long sequence, narrow model, so a full-matrix count would double the attention term
    cfg = GPTConfig(vocab_size=64, seq_len=128, d_model=64, n_heads=2, n_layers=2)
    model = GPTWithLoss(cfg)
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=SyntheticTokens(
        num_samples=32, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(tmp_path / "p.txt"),
                           "recompute_fwd_factor": 0.5}})
    seen = []
    engine.sinks.append(seen.append)
    try:
        for i, batch in enumerate(loader):
            if i == 8:
                break
            engine.backward(engine(batch))
            engine.step()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [m.step for m in seen] == [1, 2, 3, 4]
    assert seen[0].flops is None and seen[0].mfu is None
    per_step = 2 * analytical_training_flops(cfg, batch=2)  # two micro-batches per step
    fwd = per_step / 3
    for m in seen[1:]:
        assert m.flops == pytest.approx(per_step - 0.5 * fwd, rel=0.02)
        assert 0 < m.mfu <= 1 and m.mfu < m.hfu <= 1
        assert math.isclose(m.hfu / m.mfu, per_step / (per_step - 0.5 * fwd), rel_tol=0.02)
    assert "Profile Summary at step 2" in (tmp_path / "p.txt").read_text()
    # nothing of the profiler stays on the model after its step
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
