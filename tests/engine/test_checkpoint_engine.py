"""Checkpoint safety through the engine's own save/load: retention, refusal of corrupted, too-new and
mismatched checkpoints (CheckpointError before any state changes), and a save killed mid-write that
is never loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepfleet.engine.checkpoint import layout
from tests.spawn import spawn

ROOT = Path(__file__).resolve().parents[2]


def _engine(*, d_model: int = 32, n_layers: int = 2, vocab: int = 64, stage: int = 0):
    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, seq_len=16, d_model=d_model, n_heads=2, n_layers=n_layers)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepfleet.initialize(model=GPTWithLoss(cfg), config=config)
    return engine


def _step(engine, *, vocab: int = 64) -> None:
    idx = torch.randint(0, vocab, (2, 17))
    loss = engine({"input_ids": idx[:, :-1], "labels": idx[:, 1:]})
    engine.backward(loss)
    engine.step()


def _errors_and_retention(rank: int, world: int, root: str) -> dict:
    from deepfleet.engine.checkpoint.layout import CheckpointError

    root_path = Path(root)
    engine = _engine()
    for _ in range(4):
        _step(engine)
        engine.save_checkpoint(root, keep_last=2)
    kept = sorted(p.name for p in root_path.iterdir())
    out: dict = {"kept": kept, "latest": layout.read_latest(root_path)}

    def refusal(tag: str | None = None, **kwargs) -> str:
        try:
            engine.load_checkpoint(root, tag=tag, **kwargs)
        except CheckpointError as e:
            return str(e)
        return "loaded"

    # A different model: refused by name before anything is read.
    out["shape"] = _refusal_other_model(root)
    # Corrupt one shard of the newest checkpoint.
    before = [p.detach().clone() for p in engine.module.parameters()]
    shard = root_path / "global_step4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    out["corrupt"] = refusal()
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    # A manifest written by a newer deepfleet.
    manifest = root_path / "global_step3" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["format_version"] = layout.FORMAT_VERSION + 1
    manifest.write_text(json.dumps(raw))
    out["newer"] = refusal(tag="global_step3")
    out["bad_tag"] = refusal(tag="../elsewhere")
    out["missing_tag"] = refusal(tag="global_step99")
    return out


def _refusal_other_model(root: str) -> str:
    from deepfleet.engine.checkpoint.layout import CheckpointError

    other = _engine(d_model=48)
    try:
        other.load_checkpoint(root)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.slow
def test_retention_and_refusals() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        out = spawn(_errors_and_retention, 1, root)[0]
    assert out["kept"] == ["global_step3", "global_step4", "latest"]
    assert out["latest"] == "global_step4"
    assert "checkpoint does not fit the current model" in out["shape"]
    assert "model.gpt.tok.weight has shape [64, 32] in the checkpoint, [64, 48] in the model" in out["shape"]
    assert "global_step4/__0_0.distcp: sha256" in out["corrupt"] and "corrupted" in out["corrupt"]
    assert out["untouched"]
    assert "global_step3/manifest.json: format_version 2 is newer than this deepfleet understands" in out["newer"]
    assert "tag: '../elsewhere' is not a valid checkpoint tag" in out["bad_tag"]
    assert out["missing_tag"].endswith("global_step99: no such checkpoint directory")


# --- a save killed mid-write ------------------------------------------------------------------------

_BIG = {"d_model": 384, "n_layers": 4, "vocab": 512}  # ~7.5 M params: ~90 MB of model+Adam state per save


def kill_child(root: str) -> None:
    """Run in a subprocess: save global_step1 completely, announce it, then start global_step2."""
    torch.set_num_threads(1)
    engine = _engine(**_BIG)
    _step(engine, vocab=_BIG["vocab"])
    engine.save_checkpoint(root)
    print("saved-1", flush=True)
    _step(engine, vocab=_BIG["vocab"])
    engine.save_checkpoint(root)
    print("saved-2", flush=True)
    time.sleep(60)


def _load_latest(rank: int, world: int, root: str) -> str | None:
    return _engine(**_BIG).load_checkpoint(root)[0]


@pytest.mark.slow
def test_save_killed_mid_write_is_never_loaded(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    code = f"from tests.engine.test_checkpoint_engine import kill_child; kill_child({str(tmp_path)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "saved-1"
        shard = tmp_path / "global_step2" / "__0_0.distcp"
        deadline = time.monotonic() + 120
        while not shard.exists():  # the shard file appears when DCP starts writing it
            assert child.poll() is None and time.monotonic() < deadline, "the second save never started"
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    partial = tmp_path / "global_step2"
    assert partial.is_dir() and not layout.is_complete(partial)
    assert layout.read_latest(tmp_path) == "global_step1"
    assert layout.find_latest_complete(tmp_path) == "global_step1"
    assert spawn(_load_latest, 1, str(tmp_path))[0] == str(tmp_path / "global_step1")
    # Even a `latest` that names the killed directory (a crash while overwriting) is not followed.
    layout.write_latest(tmp_path, "global_step2")
    assert layout.find_latest_complete(tmp_path) == "global_step1"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_never_stepped_engine_loads_at_every_stage(tmp_path: Path, stage: int) -> None:
    assert spawn(_save_then_fresh_load, 2, str(tmp_path), stage)[0]


def _save_then_fresh_load(rank: int, world: int, root: str, stage: int) -> bool:
    trained = _engine(stage=3)
    torch.manual_seed(rank)
    for _ in range(2):
        _step(trained)
    trained.save_checkpoint(root)
    expected = trained.sharding.state_dict()
    fresh = _engine(stage=stage)  # never stepped: its optimizer has no state until the load
    fresh.load_checkpoint(root)
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    got = fresh.sharding.state_dict()
    same_model = all(torch.equal(full(got["model"][k]), full(v)) for k, v in expected["model"].items())
    same_optim = all(
        torch.equal(full(got["optim"]["state"][fqn][name]).float(), full(v).float())
        for fqn, entries in expected["optim"]["state"].items()
        for name, v in entries.items()
    )
    return same_model and same_optim and fresh.global_steps == 2
