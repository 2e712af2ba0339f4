"""Step-directory I/O on DCP with plain FSDP2/DDP models: resharding 2 -> 1 and 2 -> 3, async == sync,
checksums, shape checks and interrupted saves (engine/checkpoint/io.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.io import StepReader, StepWriter, flat_tensors
from deepfleet.engine.checkpoint.layout import CheckpointError
from deepfleet.engine.checkpoint.manifest import read_manifest
from tests.spawn import spawn


def _gpt_cfg(d_model: int = 32):
    from examples.gpt.model import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=16, d_model=d_model, n_heads=2, n_layers=2)


def _fsdp_model_and_optim(d_model: int = 32, *, wrap: str = "fsdp"):
    """A TinyGPT sharded with FSDP2 (per block + root) or wrapped in DDP, plus AdamW, seeded."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from examples.gpt.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(_gpt_cfg(d_model))
    if wrap == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert dist.is_initialized()
    return model, wrapped, optim


def _train(wrapped, optim, steps: int, *, rank: int, world: int, start: int = 0) -> list[float]:
    """Global batch of 6 sequences per step, split over ranks; returns the global mean losses."""
    import torch.distributed as dist
    import torch.nn.functional as F

    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, 64, (6, 17), generator=g)
        mine = idx[rank::world]
        logits = wrapped(mine[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        # DDP/FSDP average gradients over ranks; uneven splits at ws=4 are avoided by the callers.
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach() * mine.shape[0]
        dist.all_reduce(total)
        losses.append(total.item() / 6)
    return losses


def _state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _set_state(model, optim, state):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save_rank(rank: int, world: int, root: str, async_save: bool) -> list[float]:
    model, wrapped, optim = _fsdp_model_and_optim()
    _train(wrapped, optim, 2, rank=rank, world=world)
    writer = StepWriter()
    fields = dict(global_steps=2, micro_steps=2, world_size=world, zero_stage=3, config_hash=None,
                  deepfleet_version="test", torch_version=torch.__version__)
    writer.save(Path(root) / "global_step2", tensors=_state(model, optim), rank_state={"rank": rank},
                shared_state={"global_steps": 2}, manifest_fields=fields, async_save=async_save)
    # With an async save, these steps run while the shards are written; the checkpoint must not see them.
    after = _train(wrapped, optim, 2, rank=rank, world=world, start=2)
    writer.close()
    return after


def _load_rank(rank: int, world: int, root: str, wrap: str) -> list[float]:
    model, wrapped, optim = _fsdp_model_and_optim(wrap=wrap)
    # A different random init, so only a real load makes the losses match.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    writer = StepWriter()
    reader = StepReader(Path(root) / layout.find_latest_complete(Path(root)), group=writer.group)
    reader.verify()
    state = _state(model, optim)
    reader.check_shapes(state)
    reader.load_tensors(state)
    _set_state(model, optim, state)
    assert reader.rank_state(rank) == ({"rank": rank} if rank < 2 else None)
    assert reader.shared_state() == {"global_steps": 2}
    return _train(wrapped, optim, 2, rank=rank, world=world, start=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("ckpt")
    after = spawn(_save_rank, 2, str(root), False)[0]
    return root, after


def test_save_writes_complete_step_with_manifest(saved) -> None:
    root, _ = saved
    step = root / "global_step2"
    assert layout.is_complete(step)
    assert layout.read_latest(root) == "global_step2"
    manifest = read_manifest(step)
    assert manifest.world_size == 2 and manifest.global_steps == 2
    on_disk = {p.name for p in step.iterdir()} - {"manifest.json", "COMPLETE"}
    assert set(manifest.files) == on_disk
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt", "engine_state.pt"} <= on_disk


@pytest.mark.parametrize("world,wrap", [pytest.param(1, "fsdp", marks=pytest.mark.slow), pytest.param(3, "fsdp", marks=pytest.mark.slow), (2, "ddp")])
def test_load_reshards_and_training_continues_identically(saved, world: int, wrap: str) -> None:
    root, after = saved
    resumed = spawn(_load_rank, world, str(root), wrap)[0]
    assert resumed == pytest.approx(after, rel=1e-5)


@pytest.mark.slow
def test_async_save_equals_sync_save(saved, tmp_path: Path) -> None:
    root, after = saved
    after_async = spawn(_save_rank, 2, str(tmp_path), True)[0]
    assert after_async == after
    sync_step, async_step = root / "global_step2", tmp_path / "global_step2"
    assert read_manifest(async_step).async_save
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (sync_step / name).read_bytes() == (async_step / name).read_bytes()
    # And it loads like the synchronous one.
    assert spawn(_load_rank, 1, str(tmp_path), "fsdp")[0] == pytest.approx(after, rel=1e-5)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupted_shard_is_named(saved, tmp_path: Path) -> None:
    step = _copy(saved[0] / "global_step2", tmp_path / "global_step2")
    shard = step / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: sha256 .* corrupted"):
        StepReader(step).verify()


def test_truncated_and_missing_files_are_named(saved, tmp_path: Path) -> None:
    step = _copy(saved[0] / "global_step2", tmp_path / "global_step2")
    (step / "rank1.pt").unlink()
    with open(step / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: size 10 bytes"):
        StepReader(step).verify()
    (step / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: listed in the manifest but missing"):
        StepReader(step).verify()


def test_newer_manifest_is_refused(saved, tmp_path: Path) -> None:
    step = _copy(saved[0] / "global_step2", tmp_path / "global_step2")
    raw = json.loads((step / "manifest.json").read_text())
    raw["format_version"] = layout.FORMAT_VERSION + 1
    (step / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"manifest.json: format_version 2 is newer"):
        StepReader(step)


def test_interrupted_save_is_not_loaded(saved, tmp_path: Path) -> None:
    step = _copy(saved[0] / "global_step2", tmp_path / "global_step2")
    (step / "COMPLETE").unlink()
    assert layout.find_latest_complete(tmp_path) is None
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        StepReader(step)


def _wrong_shape_rank(rank: int, world: int, root: str) -> str:
    from examples.gpt.model import TinyGPT

    model = TinyGPT(_gpt_cfg(d_model=48))
    optim = torch.optim.AdamW(model.parameters())
    reader = StepReader(Path(root) / "global_step2")
    try:
        reader.check_shapes(_state(model, optim))
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_different_model_shape_is_refused(saved) -> None:
    message = spawn(_wrong_shape_rank, 1, str(saved[0]))[0]
    assert ".metadata: checkpoint does not fit the current model" in message
    assert "model.tok.weight has shape [64, 32] in the checkpoint, [64, 48] in the model" in message


def test_flat_tensors_uses_dcp_key_names() -> None:
    t = torch.zeros(2)
    state = {"model": {"a.b": t}, "optim": {"state": {"a.b": {"exp_avg": t, "step": 3}}, "param_groups": [{}]}}
    assert set(flat_tensors(state)) == {"model.a.b", "optim.state.a.b.exp_avg"}
