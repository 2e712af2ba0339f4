"""The `checkpoint` section (tag validation across ranks; DeepSpeed's storage switches) and the `compile`
section (torch.compile of the wrapped model)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError, load_config
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens
from tests.spawn import spawn

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_checkpoint_section_keys() -> None:
    cfg = load_config({"train_batch_size": 2, "checkpoint": {"tag_validation": "fail", "load_universal": True,
                                                             "parallel_write": {"pipeline_stage": True}}})
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.load_universal
    with pytest.raises(ConfigError, match="checkpoint.use_node_local_storage: .*node-local checkpoint storage"):
        load_config({"train_batch_size": 2, "checkpoint": {"use_node_local_storage": True}})
    with pytest.raises(ConfigError, match="checkpoint.tag_validation"):
        load_config({"train_batch_size": 2, "checkpoint": {"tag_validation": "Sometimes"}})


def _save_with_rank_tags(rank: int, world_size: int, ckpt: str) -> dict[str, str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("deepfleet.engine.checkpoint.api").addHandler(Keep())
    out = {}
    for mode in ("Warn", "Fail"):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=GPTWithLoss(TINY),
                                          config={**BASE, "checkpoint": {"tag_validation": mode}})
        records.clear()
        try:
            engine.save_checkpoint(f"{ckpt}/{mode}", tag=f"tag{rank}")
            out[mode] = "; ".join(records)
        except Exception as e:  # noqa: BLE001 - the result is what the test checks
            out[mode] = f"raised: {e}"
        dist.barrier()
    return out


def test_tag_validation_across_ranks(tmp_path) -> None:
    for result in spawn(_save_with_rank_tags, 2, str(tmp_path)):
        assert "tag_validation=Warn: checkpoint tag differs across ranks: ['tag0', 'tag1']" in result["Warn"]
        assert result["Fail"].startswith("raised: checkpoint.tag_validation=Fail")
    assert not (tmp_path / "Fail").exists()


def test_compile_section_compiles_the_model() -> None:
    torch.set_num_threads(1)
    data = SyntheticTokens(num_samples=8, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    losses = {}
    for enabled in (False, True):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=GPTWithLoss(TINY),
                                          config={**BASE, "compile": {"enabled": enabled, "backend": "eager"}})
        run = []
        for _ in range(3):
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[enabled] = run
        assert (engine.sharding.module._compiled_call_impl is not None) == enabled
        dist.destroy_process_group()
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
