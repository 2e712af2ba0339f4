"""Random-LTD (`data_efficiency.data_routing.random_ltd`): DeepSpeed's kept-length schedule, the listed
blocks seeing only the kept tokens (the others pass unchanged), the same tokens when activation
checkpointing recomputes a block, the scheduler in checkpoints, DeepSpeed's wrapper API, and the
config's errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.data_routing import (
    RandomLTDScheduler,
    TokenDropHooks,
    convert_to_random_ltd,
    save_without_random_ltd,
)
from examples.gpt.model import Block, GPTConfig, GPTWithLoss, SyntheticTokens

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _section(layer_ids=(1,), total=2, lo=4, hi=16, steps=4, per=2, **extra) -> dict:
    return {"enabled": True, "total_layer_num": total, "random_ltd_layer_num": len(layer_ids),
            "random_ltd_layer_id": list(layer_ids), "random_ltd_schedule": {
                "min_value": lo, "max_value": hi, "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": steps, "seq_per_step": per}}, **extra}


def _config(section: dict, **top) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "data_efficiency": {"enabled": True, "seed": 7, "data_routing": {"enabled": True, "random_ltd": section}},
            **top}


def test_the_kept_length_follows_deepspeeds_fixed_linear_rule() -> None:
    cfg = load_config(_config(_section(lo=16, hi=64, steps=10, per=8, total=4, layer_ids=(1, 2))))
    s = RandomLTDScheduler(cfg.data_efficiency.random_ltd(), global_batch_size=2)
    # floor(s/10 * 48 + 16) rounded down to a multiple of 8, capped at 64
    assert [s.get_value(step) for step in (0, 3, 5, 10, 20)] == [16, 24, 40, 64, 64]
    s.update_seq(5)
    s.update_seq(5)  # the same step counts its layer-tokens once
    assert s.get_current_seq() == 40
    assert s.consumed_layer_tokens == 2 * (40 * 2 + 64 * 2)


class PerToken(nn.Module):
    """A block that acts on each token alone, so its output on the kept tokens is checkable."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def test_a_dropping_block_sees_the_kept_tokens_and_the_others_pass_unchanged() -> None:
    torch.manual_seed(0)
    cfg = load_config(_config(_section(lo=5, hi=12, per=1, layer_ids=(0,), total=1)))
    scheduler = RandomLTDScheduler(cfg.data_efficiency.random_ltd(), global_batch_size=2, seed=3)
    block = PerToken(8)
    seen: list[torch.Size] = []
    TokenDropHooks(scheduler, [block])
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))  # after ours: sees the cut input
    x = torch.randn(3, 12, 8)
    scheduler.update_seq(0)
    scheduler.new_micro_batch(0)
    y = block(x)
    kept = scheduler.indices(0, 3, 12, x.device)
    assert seen == [torch.Size([3, 5, 8])]
    assert kept.shape == (3, 5) and bool((kept.diff(dim=1) > 0).all())  # order-preserving, distinct
    reference = x + torch.tanh(block.lin(x))
    mask = torch.zeros(3, 12, dtype=torch.bool).scatter(1, kept, True)
    assert torch.equal(y[mask], reference[mask]) and torch.equal(y[~mask], x[~mask])
    block.eval()  # evaluation forwards drop nothing
    assert torch.equal(block(x), reference)


class Stack(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PerToken(8) for _ in range(3))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return x.pow(2).mean()


def _grads(recompute: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Stack(recompute)
    x = torch.randn(2, 10, 8)
    engine, *_ = deepspeed.initialize(model=model, config=_config(_section(lo=4, hi=10, total=3, layer_ids=(0, 2))))
    engine.backward(engine(x))
    return [p.grad.clone() for p in engine.module.parameters()]


def test_recomputation_sees_the_same_kept_tokens() -> None:
    for plain, recomputed in zip(_grads(False), _grads(True), strict=True):
        assert torch.equal(plain, recomputed)


TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _gpt_engine(section: dict, stage: int = 0):  # noqa: ANN202
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=GPTWithLoss(TINY),
                                      config=_config(section, zero_optimization={"stage": stage}))
    return engine


def _batches(n: int):  # noqa: ANN202
    data = SyntheticTokens(num_samples=2 * n, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    for i in range(n):
        rows = [data[2 * i], data[2 * i + 1]]
        yield {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_drops_tokens_in_the_listed_blocks_and_checkpoints_the_schedule(tmp_path, stage: int) -> None:
    engine = _gpt_engine(_section(lo=4, hi=16, steps=4, per=2), stage)
    blocks = engine.module.gpt.blocks
    lengths: dict[int, list[int]] = {0: [], 1: []}
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: lengths[i].append(args[0].shape[1]))
    for batch in _batches(3):
        engine.backward(engine(batch))
        engine.step()
    seq = next(_batches(1))["input_ids"].shape[1]
    assert lengths[0] == [seq] * 3  # block 0 is not listed
    assert lengths[1] == [4, 6, 10]  # floor(s/4 * 12 + 4) rounded to a multiple of 2, for steps 0, 1, 2
    # the plain model's keys: nothing was rewritten
    assert set(engine.module.state_dict()) == set(GPTWithLoss(TINY).state_dict())
    engine.save_checkpoint(str(tmp_path))
    resumed = _gpt_engine(_section(lo=4, hi=16, steps=4, per=2), stage)
    resumed.load_checkpoint(str(tmp_path))
    a, b = engine.random_ltd_scheduler.state_dict(), resumed.random_ltd_scheduler.state_dict()
    assert a.pop("generator").equal(b.pop("generator")) and a == b and a["current_value"] == 10


def test_deepspeeds_wrapper_api() -> None:
    from deepfleet.engine.runtime.data_pipeline.data_routing import basic_layer, helper

    assert helper.convert_to_random_ltd is convert_to_random_ltd  # at DeepSpeed's paths
    assert basic_layer.RandomLayerTokenDrop.__module__ == "deepfleet.engine.data_routing"
    engine = _gpt_engine(_section(layer_ids=(0, 1), lo=6, hi=16))
    convert_to_random_ltd(engine, Block)
    assert any(".random_ltd_layer." in key for key in engine.module.state_dict())
    assert set(save_without_random_ltd(engine)) == set(GPTWithLoss(TINY).state_dict())
    lengths: list[int] = []
    engine.module.gpt.blocks[1].random_ltd_layer.register_forward_pre_hook(
        lambda m, args: lengths.append(args[0].shape[1]))
    engine.backward(engine(next(_batches(1))))
    engine.step()
    assert lengths == [6]


@pytest.mark.parametrize(("section", "message"), [
    (_section(total=3), "random_ltd.total_layer_num: 3, the model has 2 blocks; set it to 2"),
    (_section(layer_ids=(2,)), r"random_ltd_layer_id: \[2\] outside 0..1"),
    ({**_section(), "random_ltd_layer_num": 2}, r"random_ltd_layer_num: 2 != len\(random_ltd_layer_id\) = 1"),
    (_section(lo=20, hi=16), "min_value: 20 is above max_value 16"),
    ({**_section(), "layer_token_lr_schedule": {"enabled": True}}, "layer_token_lr_schedule: not supported yet"),
])
def test_config_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        _gpt_engine(section)
