"""Activation checkpointing: DeepSpeed's `checkpointing` API as Megatron-style scripts call it, the
`activation_checkpointing` and `deepfleet_activation_checkpointing` sections, numerics equal to plain runs
(torch.equal: the recomputation replays the same ops on the same inputs in the same order, single-threaded
on the CPU, so every float is identical), and the saved-activation bytes that checkpointing removes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from deepfleet.engine.activation_checkpointing import BlockChoice, apply_block_choices, choices_from_config
from deepfleet.engine.activation_memory import ActivationBytes
from deepfleet.engine.blocks import blocks
from deepfleet.engine.compat import checkpointing as ck
from deepfleet.engine.config import ConfigError, load_config
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

REPO = Path(__file__).resolve().parents[2]
MODEL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
BASE = {"train_batch_size": 2}


@pytest.fixture(autouse=True)
def _unconfigured():
    """The DeepSpeed API's settings are process-global; each test starts and ends unconfigured."""
    ck._SETTINGS = ck._Settings()
    yield
    ck._SETTINGS = ck._Settings()


def _batch(n: int = 4) -> dict[str, torch.Tensor]:
    data = SyntheticTokens(num_samples=n, seq_len=MODEL.seq_len, vocab_size=MODEL.vocab_size)
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in ("input_ids", "labels")}


def _run(choices: list[BlockChoice] | None, *, measure: bool = False, ops=("matmul", "attention")):
    torch.manual_seed(0)
    model = GPTWithLoss(MODEL)
    if choices:
        apply_block_choices(blocks(model), choices, ops=ops)
    meter = ActivationBytes()
    with meter if measure else torch.enable_grad():
        loss = model(_batch())
        meter.mark_forward()
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, meter


# --------------------------------------------------------------------------- config sections


def test_deepspeed_section_is_accepted_and_errors_name_the_key() -> None:
    cfg = load_config({**BASE, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}})
    assert cfg.activation_checkpointing.number_checkpoints == 4
    assert load_config({**BASE, "activation_checkpointing": {"number_checkpoints": False}}) \
        .activation_checkpointing.number_checkpoints is None  # DeepSpeed's examples write false for "unset"
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "activation_checkpointing": {"contiguous_memory_optimization": True, "cpu_ckpt": True}})
    assert e.value.errors == [
        "activation_checkpointing.contiguous_memory_optimization: needs number_checkpoints (the checkpoints per "
        "forward); set it or drop contiguous_memory_optimization",
        "activation_checkpointing.contiguous_memory_optimization: needs partition_activations: true (as in "
        "DeepSpeed); set partition_activations or drop contiguous_memory_optimization",
        "activation_checkpointing.cpu_ckpt: unknown key; did you mean activation_checkpointing.cpu_checkpointing? "
        "remove or rename it",
    ]


def test_block_section_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "deepfleet_activation_checkpointing": {"mode": "layers", "every": 0, "ops": ["conv"]}})
    assert [line.split(":")[0] for line in e.value.errors] == [
        "deepfleet_activation_checkpointing.every", "deepfleet_activation_checkpointing.mode",
        "deepfleet_activation_checkpointing.ops"]
    section = load_config({**BASE, "deepfleet_activation_checkpointing": {"mode": "blocks", "every": 2}}) \
        .deepfleet_activation_checkpointing
    assert [c.recompute for c in choices_from_config(section, 5)] == ["full", "none", "full", "none", "full"]
    with pytest.raises(ValueError, match=r"^deepfleet_activation_checkpointing.ops: 'aten.no_such_op' is not"):
        apply_block_choices(blocks(GPTWithLoss(MODEL)), [BlockChoice("selective")] * 4, ops=["aten.no_such_op"])


# --------------------------------------------------------------------------- numerics and bytes


@pytest.mark.parametrize("choices", [
    [BlockChoice("full")] * 4,
    [BlockChoice("none"), BlockChoice("full")] * 2,
    [BlockChoice("selective")] * 4,
    [BlockChoice("full", offload=True), BlockChoice("none", offload=True)] * 2,
], ids=["every-block", "every-2nd", "selective", "offload"])
def test_checkpointed_blocks_give_identical_loss_and_gradients(choices) -> None:
    loss, grads, _ = _run(None)
    ac_loss, ac_grads, _ = _run(choices)
    assert torch.equal(loss, ac_loss)
    assert grads.keys() == ac_grads.keys()  # parameter names are the model's own
    assert all(torch.equal(grads[k], ac_grads[k]) for k in grads)


def test_checkpointing_drops_saved_activation_bytes() -> None:
    plain = _run(None, measure=True)[2]
    every = _run([BlockChoice("full")] * 4, measure=True)[2]
    half = _run([BlockChoice("none"), BlockChoice("full")] * 2, measure=True)[2]
    selective = _run([BlockChoice("selective")] * 4, measure=True)[2]
    # what the forward keeps: all blocks' activations > half of them > selective's kept matmuls > inputs only
    assert plain.forward_bytes > half.forward_bytes > every.forward_bytes
    assert plain.forward_bytes > selective.forward_bytes > every.forward_bytes
    # per block, a full checkpoint keeps only the block input (batch 4 x seq 16 x d_model 32 fp32 = 8 KiB)
    per_block = (plain.forward_bytes - every.forward_bytes) / 4
    assert per_block > 8 * 4 * 16 * 32 * 4
    assert plain.peak_bytes > every.peak_bytes


# --------------------------------------------------------------------------- DeepSpeed's API


def test_megatron_style_configure_then_checkpoint(caplog) -> None:
    import deepfleet.engine as deepspeed

    cfg = {**BASE, "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                "profile": True}}
    assert not deepspeed.checkpointing.is_configured()
    deepspeed.checkpointing.configure(None, deepspeed_config=cfg, num_checkpoints=4)
    assert deepspeed.checkpointing.is_configured()
    assert ck._SETTINGS.checkpoint_in_cpu and ck._SETTINGS.partition_activations and ck._SETTINGS.num_checkpoints == 4
    torch.manual_seed(0)
    model = GPTWithLoss(MODEL).gpt
    x = torch.randn(2, MODEL.seq_len, MODEL.d_model, requires_grad=True)
    caplog.set_level("INFO", logger="deepfleet.engine.compat.checkpointing")
    h = x
    for block in model.blocks:
        h = deepspeed.checkpointing.checkpoint(block, h)
    h.square().sum().backward()
    ckpt_grads = [x.grad, *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
    assert sum("checkpoint forward" in r.message for r in caplog.records) == 4
    assert sum("checkpoint backward" in r.message for r in caplog.records) == 4
    x.grad = None
    model.zero_grad(set_to_none=True)
    h = x
    for block in model.blocks:
        h = block(h)
    h.square().sum().backward()
    plain_grads = [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]
    assert all(torch.equal(a, b) for a, b in zip(ckpt_grads, plain_grads, strict=True))


def test_configure_refuses_what_deepspeed_refuses_and_partitioning_over_model_parallel_ranks() -> None:
    with pytest.raises(ValueError, match=r"^contiguous_checkpointing: needs partition_activations"):
        ck.configure(None, contiguous_checkpointing=True)

    class MPU:
        def get_model_parallel_world_size(self) -> int:
            return 2

        def get_model_parallel_rank(self) -> int:
            return 1

    with pytest.raises(ValueError, match=r"^partition_activations: partitioning over 2 model-parallel ranks"):
        ck.configure(MPU(), partition_activations=True)
    ck.configure(MPU())  # without partitioning, an mpu only supplies the tensor-parallel rank for seeding
    ck.model_parallel_cuda_manual_seed(5)
    assert "model-parallel-rng" in ck.get_cuda_rng_tracker().get_states()
    with pytest.raises(ConfigError, match=r"activation_checkpointing.profile: expected true or false"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"profile": "yes"}})


class DropoutBlock(nn.Module):
    """Dropout under the tracker's fork (Megatron's model-parallel regions) and outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with ck.get_cuda_rng_tracker().fork():
            x = nn.functional.dropout(self.fc(x), 0.5)
        return nn.functional.dropout(x, 0.3)


def test_recomputation_replays_tracker_and_default_rng() -> None:
    ck.configure(None)
    block = DropoutBlock()
    x = torch.randn(8, 16, requires_grad=True)
    results = []
    for use_checkpoint in (True, False):
        ck.model_parallel_cuda_manual_seed(123)
        out = ck.checkpoint(block, x) if use_checkpoint else block(x)
        # the tracker and the default generator advance between forward and backward, as in training
        with ck.get_cuda_rng_tracker().fork():
            torch.rand(100)
        torch.rand(100)
        out.sum().backward()
        results.append((out.detach(), x.grad.clone(), block.fc.weight.grad.clone()))
        x.grad = None
        block.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.usefixtures("one_rank_group")  # initialize() makes a one-rank group: drop it after
def test_initialize_configures_the_api_from_the_section() -> None:
    from deepfleet.engine import initialize

    torch.manual_seed(0)
    engine, *_ = initialize(model=GPTWithLoss(MODEL), config={
        **BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}})
    assert ck.is_configured() and ck._SETTINGS.checkpoint_in_cpu and ck._SETTINGS.synchronize
    engine.destroy()


def test_deepspeed_module_paths_under_deepfleet_run() -> None:
    code = (
        "import torch\n"
        "from deepfleet.engine.compat import deepspeed_alias\n"
        "deepspeed_alias.install()\n"
        "import deepspeed\n"
        "from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt\n"
        "assert ds_ckpt.checkpoint is deepspeed.checkpointing.checkpoint\n"
        "deepspeed.checkpointing.configure(None, deepspeed_config={'train_batch_size': 1})\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "x = torch.randn(2, 4, requires_grad=True)\n"
        "deepspeed.checkpointing.checkpoint(lin, x).sum().backward()\n"
        "assert deepspeed.checkpointing.is_configured() and x.grad is not None\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
