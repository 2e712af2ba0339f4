"""AutoTP training (`tensor_parallel.autotp_size`): the blocks' Linears split column/row over the tp axis,
at ZeRO 0-2, with data parallelism beside it; losses, clipped gradients and whole weights equal the
untouched model's; checkpoints resume at the same and at another tp degree; bad setups are one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import deepfleet.engine as deepspeed
from deepfleet.engine.autotp import plan
from deepfleet.engine.config import ConfigError, load_config
from examples.gpt.model import GPTConfig, TinyGPT
from tests.spawn import spawn

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


class MLPBlock(nn.Module):
    """A block without fused weights: fc (column) then out (row)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class MLPNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class GPTLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(CFG)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return gpt_loss(self.gpt, batch)


def batches(step: int, dp_rank: int, dp: int, micro: int, kind: str) -> torch.Tensor:
    """The global batch of `step` (the same on every run), this data-parallel rank's rows."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = micro * dp
    if kind == "gpt":
        full = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len + 1), generator=g)
    else:
        full = torch.randn(rows, 8, generator=g)
    return full[dp_rank * micro:(dp_rank + 1) * micro]


def _run(rank: int, world: int, kind: str, stage: int, tp: int, steps: int, micro: int, save: str | None,
         load: str | None) -> dict:
    torch.manual_seed(0)
    model = GPTLoss() if kind == "gpt" else MLPNet()
    dp = world // tp
    config = {"train_batch_size": micro * dp, "train_micro_batch_size_per_gpu": micro,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "gradient_clipping": 0.05, "zero_optimization": {"stage": stage},
              "tensor_parallel": {"autotp_size": tp if tp > 1 else 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    start = 0
    if load is not None:
        engine.load_checkpoint(load)
        start = engine.global_steps
    dp_rank = engine.parallel.dp_rank
    losses, norms = [], []
    for step in range(start, start + steps):
        loss = engine(batches(step, dp_rank, dp, micro, kind))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    if save is not None:
        engine.save_checkpoint(save)
    from deepfleet.engine.autotp import gather_full_state

    whole = {k: v.clone() for k, v in gather_full_state(engine.module, engine.module.state_dict()).items()}
    local_shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "state": whole, "shapes": local_shapes,
            "heads": [b.n_heads for b in engine.module.gpt.blocks] if kind == "gpt" else None}


def _close(a: list[float], b: list[float], tol: float = 2e-5) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def test_the_plan_pairs_column_and_row_layers_of_each_block() -> None:
    chosen = plan(TinyGPT(CFG), load_config({"train_batch_size": 1}).tensor_parallel)
    assert chosen == {f"blocks.{i}.{n}": v for i in range(2)
                      for n, v in (("qkv", ("column", 3)), ("proj", ("row", 1)), ("fc", ("column", 1)),
                                   ("out", ("row", 1)))}
    custom = load_config({"train_batch_size": 1, "tensor_parallel": {"autotp_size": 2, "partition_config": {
        "use_default_specs": False, "layer_specs": [
            {"patterns": [r"\.fc\.weight$"], "partition_type": "column"},
            {"patterns": [r"\.out\.weight$"], "partition_type": "row"}]}}}).tensor_parallel
    assert set(plan(TinyGPT(CFG), custom)) == {"blocks.0.fc", "blocks.0.out", "blocks.1.fc", "blocks.1.out"}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tp2_trains_like_the_whole_model_at_every_zero_stage(stage) -> None:
    reference = spawn(_run, 1, "gpt", stage, 1, 4, 4, None, None)[0]
    split = spawn(_run, 2, "gpt", stage, 2, 4, 4, None, None)
    for r in split:
        assert _close(r["losses"], reference["losses"]), (r["losses"], reference["losses"])
        # the clipped norm is the whole model's (every rank reports it), so clipping acted alike
        assert _close(r["norms"], reference["norms"], 1e-4), (r["norms"], reference["norms"])
        assert r["heads"] == [2, 2]
        assert r["shapes"]["gpt.blocks.0.qkv.weight"] == (48, 32) and r["shapes"]["gpt.blocks.0.proj.weight"] == (32, 16)
    for name, value in reference["state"].items():
        torch.testing.assert_close(split[0]["state"][name], value, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert min(reference["norms"]) > 0.05  # clipping was active


def test_tp2_with_data_parallelism_beside_it_at_zero2() -> None:
    # ranks (0, 1) and (2, 3) are tp groups on data-parallel ranks 0 and 1
    reference = spawn(_run, 2, "gpt", 2, 1, 3, 2, None, None)  # the same data over 2 dp ranks, no tp
    tp_dp = spawn(_run, 4, "gpt", 2, 2, 3, 2, None, None, timeout=300)
    for rank, dp_rank in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert _close(tp_dp[rank]["losses"], reference[dp_rank]["losses"]), rank
        assert _close(tp_dp[rank]["norms"], reference[dp_rank]["norms"], 1e-4), rank
    for name, value in reference[0]["state"].items():
        torch.testing.assert_close(tp_dp[3]["state"][name], value, rtol=1e-4, atol=5e-5, msg=name)


def test_checkpoints_resume_at_the_same_and_at_another_tp_degree(tmp_path) -> None:
    straight = spawn(_run, 2, "mlp", 1, 2, 4, 4, None, None)
    spawn(_run, 2, "mlp", 1, 2, 2, 4, str(tmp_path / "mlp"), None)
    again = spawn(_run, 2, "mlp", 1, 2, 2, 4, None, str(tmp_path / "mlp"))
    assert _close(again[0]["losses"], straight[0]["losses"][2:], 1e-6)
    # at tp 1 (one rank, the whole model): DCP reassembles the whole tensors from the tp shares
    whole = spawn(_run, 1, "mlp", 1, 1, 2, 4, None, str(tmp_path / "mlp"))[0]
    assert _close(whole["losses"], straight[0]["losses"][2:], 1e-5)
    # fused q/k/v are stored in the share order of their degree: another degree is refused by name
    spawn(_run, 2, "gpt", 0, 2, 1, 4, str(tmp_path / "gpt"), None)
    manifest = json.loads(next((tmp_path / "gpt").glob("*/manifest.json")).read_text())
    assert manifest["tp_fused"] == [f"gpt.blocks.{i}.qkv.{p}" for i in range(2) for p in ("weight", "bias")]  # the names, whatever rule split them
    with pytest.raises(RuntimeError, match=r"saved at tp 2, this run is at tp 1, and its fused weights \(gpt\.blocks"):
        spawn(_run, 1, "gpt", 0, 1, 1, 4, None, str(tmp_path / "gpt"))


def _save16(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=MLPNet(), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": 2}})
    engine.save_16bit_model(path)
    return {n: tuple(p.shape) for n, p in engine.module.named_parameters()}


def test_save_16bit_model_writes_whole_weights(tmp_path) -> None:
    shapes = spawn(_save16, 2, str(tmp_path))[0]
    assert shapes["blocks.0.fc.weight"] == (32, 16) and shapes["blocks.0.out.weight"] == (16, 32)
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    torch.manual_seed(0)
    fresh = MLPNet().state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in fresh.items()}
    for k, v in fresh.items():
        torch.testing.assert_close(saved[k], v, msg=k)


class OddBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 9), nn.Linear(9, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x))


def _refused(rank: int, world: int, config: dict, model: str) -> str:
    torch.manual_seed(0)
    odd = lambda: nn.Sequential(nn.ModuleList([OddBlock()]))  # noqa: E731
    net = {"mlp": MLPNet, "plain": lambda: nn.Sequential(nn.Linear(8, 8)), "odd": odd}[model]()
    try:
        deepspeed.initialize(model=net, config={"train_batch_size": 2, "optimizer": {"type": "SGD",
                                                                                  "params": {"lr": 0.1}}, **config})
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_unsupported_combinations_and_models_are_named() -> None:
    stage3 = spawn(_refused, 2, {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}, "mlp")[0]
    assert "tensor_parallel.autotp_size: not supported together with zero_optimization.stage 3" in stage3
    nothing = spawn(_refused, 2, {"tensor_parallel": {"autotp_size": 2}}, "plain")[0]
    assert "no Linear layer of the model's blocks matches a split rule" in nothing
    odd = spawn(_refused, 2, {"tensor_parallel": {"autotp_size": 2}}, "odd")[0]
    assert "0.0.fc: out_features 9 is not divisible into 2 parts" in odd, odd
    assert "0.0.out: in_features 9 is not divisible into 2 parts" in odd
    too_big = spawn(_refused, 2, {"tensor_parallel": {"autotp_size": 4}}, "mlp")[0]
    assert "needs the world size 2 to be a multiple of" in too_big and "tp 4 = 4" in too_big


def test_config_keys() -> None:
    cfg = load_config({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False,
                                                                  "dtype": "bf16", "tp": {"tp_size": 1}}},
                      world_size=2, dp_size=1)
    assert cfg.tensor_parallel.degree == 2
    with pytest.raises(ConfigError, match="tensor_parallel.tp_overlap_comm: not supported yet"):
        load_config({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}})
    with pytest.raises(ConfigError, match="shape: fused sub-blocks are supported for column layers"):
        load_config({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2, "partition_config": {
            "layer_specs": [{"patterns": ["x"], "partition_type": "row", "shape": [2, -1]}]}}})
    assert load_config({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 0}}).tensor_parallel.degree == 1


def _tp_model_init(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = deepspeed.tp_model_init(MLPNet(), tp_size=2, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine.parallel.tp, engine.parallel.dp_size, tuple(engine.module.blocks[0].fc.weight.shape)


def test_tp_model_init_sets_the_degree_as_deepspeed_scripts_call_it() -> None:
    assert spawn(_tp_model_init, 2)[0] == (2, 1, (32, 16))
    with pytest.raises(ValueError, match="tp_size: must be a positive integer"):
        deepspeed.tp_model_init(MLPNet(), tp_size=0, dtype=torch.float32)
