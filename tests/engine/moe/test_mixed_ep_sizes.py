"""MoE layers of one model at different ep_size values (DeepSpeed allows it: each degree has its own
`ep_size_<N>` groups and optimizer param group), on 4 gloo ranks: a model whose two MoE layers use
ep_size 2 and 4 trains exactly like the same model with both at ep_size 1 (losses, gradient norms and the
gathered weights after 3 steps of 2 micro-steps) at ZeRO 2 (0, 1 and 3 under `slow`); each layer's
experts reduce over its own expert-data-parallel group (ep 2: groups of 2 ranks; ep 4: one rank), and
the optimizer gets one param group per degree. A degree that does not divide the data-parallel size is
a one-line config error naming it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch.distributed as dist

from tests.engine.moe.moe_runs import MODEL, ROUTING, config, full_params, global_batches, train
from tests.spawn import spawn

MIXED = (2, 4)  # ep_size of the first and the second MoE layer
STEPS = 3


def _model(stage: int, layer_ep_sizes: tuple[int, ...], num_experts: int = 4):  # noqa: ANN202
    import torch

    from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss

    torch.manual_seed(0)
    return MoEGPTWithLoss(MODEL, MoEArgs(num_experts=num_experts, min_capacity=2, layer_ep_sizes=layer_ep_sizes,
                                         **ROUTING[stage]))


def _run(rank: int, world_size: int, stage: int, layer_ep_sizes: tuple[int, ...]) -> dict:
    import deepfleet.engine as deepspeed

    model = _model(stage, layer_ep_sizes)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config(stage))
    initial = full_params(engine)
    out = train(engine, model, rank=rank, world_size=world_size, batches=global_batches(world_size, STEPS))
    out["params"] = full_params(engine)
    out["moved"] = {name: float(abs(value - initial[name]).max()) for name, value in out["params"].items()}
    out["held"] = [sorted({k.split("deepspeed_experts.")[1].split(".")[0] for k, _ in block.named_parameters()
                           if "deepspeed_experts." in k}) for block in model.blocks]
    out["group_names"] = [g.get("name") for g in optimizer.param_groups]
    return out


def _bad_degree(rank: int, world_size: int) -> str:
    import deepfleet.engine as deepspeed
    from deepfleet.engine.config import ConfigError

    try:
        deepspeed.initialize(model=_model(0, (2, 3), num_experts=6), config=config(0))
    except ConfigError as e:
        return str(e)
    return "no error"


def _all(rank: int, world_size: int, stages: tuple[int, ...]) -> dict:
    runs = {(stage, eps): _run(rank, world_size, stage, eps) for stage in stages for eps in ((1, 1), MIXED)}
    runs["bad"] = _bad_degree(rank, world_size)
    dist.barrier()
    return runs


@functools.cache
def _runs(stages: tuple[int, ...]) -> list[dict]:
    return spawn(_all, 4, stages, timeout=600)


def _check(runs: list[dict], stage: int) -> None:
    for rank in range(4):
        one, mixed = runs[rank][(stage, (1, 1))], runs[rank][(stage, MIXED)]
        np.testing.assert_allclose(mixed["losses"], one["losses"], atol=2e-6)
        np.testing.assert_allclose(mixed["aux"], one["aux"], atol=2e-6)
        np.testing.assert_allclose(mixed["norms"], one["norms"], rtol=1e-5)
        assert mixed["counts"] == one["counts"]
        # layer 0 (ep 2): ranks 0, 2 hold experts 0-1 and ranks 1, 3 experts 2-3; layer 1 (ep 4): one each
        assert mixed["held"][0] == [["0", "1"], ["2", "3"]][rank % 2] and mixed["held"][1] == [str(rank)]
        assert [n for n in mixed["group_names"] if n] == ["ep_size_2", "ep_size_4"]
    merged = {}
    for rank in range(4):  # every expert from a rank that holds it; dense weights must agree everywhere
        for name, value in runs[rank][(stage, MIXED)]["params"].items():
            if name in merged and "deepspeed_experts" not in name:
                np.testing.assert_array_equal(value, merged[name], err_msg=name)
            merged.setdefault(name, value)
    reference = runs[0][(stage, (1, 1))]["params"]
    assert sorted(merged) == sorted(reference)
    for name, value in reference.items():  # AdamW amplifies float noise in near-zero gradients
        np.testing.assert_allclose(merged[name], value, atol=5e-4, err_msg=name)
    for rank in range(4):  # it trains: every expert this rank holds was updated
        moved = runs[rank][(stage, MIXED)]["moved"]
        assert all(moved[name] > 1e-4 for name in moved if "deepspeed_experts" in name), moved


def test_layers_at_two_ep_sizes_train_like_ep1_at_zero_2() -> None:
    _check(_runs((2,)), 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_layers_at_two_ep_sizes_train_like_ep1(stage: int) -> None:
    _check(_runs((0, 1, 3)), stage)


def test_an_ep_size_not_dividing_the_data_parallel_size_is_a_one_line_error() -> None:
    messages = {run["bad"] for run in _runs((2,))}
    assert len(messages) == 1
    (message,) = messages
    assert "\n" not in message and message.startswith("MoE(ep_size=...): 3 does not divide the data-parallel size 4")
