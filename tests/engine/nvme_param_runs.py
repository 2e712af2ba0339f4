"""Runs for `test_nvme_param_offload.py`: a small block model trained at ZeRO stage 3 on 2 gloo ranks
with and without NVMe parameter offload (alone, with the optimizer offload, under bf16), a save / new
engine / load / continue resume, and a write that fails half-way through a unit's file."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from tests.engine.nvme_runs import batch, train

STEPS, SAVE_AT = 5, 2
HIDDEN = 9  # odd: the shards of every block are uneven at 2 ranks (FSDP2 pads them)


def config(*, params: str | None = None, optimizer: str | None = None, bf16: bool = False, ckpt: bool = False,
           gas: int = 1) -> dict:
    zero: dict = {"stage": 3}
    if params is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": params, "buffer_count": 2, "buffer_size": 200,
                                 "max_in_cpu": 0}
    if optimizer is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": optimizer, "buffer_count": 2,
                                     "pipeline_read": True, "pipeline_write": True}
        zero["sub_group_size"] = 60  # several chunks per step
    out = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
        "zero_optimization": zero,
        "aio": {"block_size": 4096, "queue_depth": 2, "thread_count": 2},
    }
    if bf16:
        out["bf16"] = {"enabled": True}
    if ckpt:
        out["deepfleet_activation_checkpointing"] = {"mode": "blocks"}
    out["gradient_accumulation_steps"] = gas
    return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Net(nn.Module):
    """Root unit: `inp` and `out` (one output row: rank 1's shard of `out.weight` is empty); three block units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, HIDDEN)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return ((self.out(h).float() - y) ** 2).mean()


def engine(cfg: dict):
    import deepfleet.engine as deepfleet

    torch.manual_seed(0)
    model = Net()
    eng, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng


def _padded_bytes(p: torch.Tensor, world_size: int, itemsize: int) -> int:
    """FSDP2's padded dim-0 shard of a parameter of global shape p.shape: every rank holds rank 0's
    rows (an empty shard, as rank 1's of a one-row weight, is all padding)."""
    rows = -(-p.shape[0] // world_size)
    return rows * (p.numel() // p.shape[0]) * itemsize


def _expected_file_bytes(unit, world_size: int) -> int:
    """A unit file: each shard's padded fp32 storage at a 64-byte-aligned offset, the total aligned."""
    offset = 0
    for p in unit.params:
        offset = (offset + _padded_bytes(p, world_size, 4) + 63) // 64 * 64
    return offset


def _storage_bytes(eng) -> list[int]:
    return [p.to_local().untyped_storage().nbytes() for u in eng.sharding.param_offload.units for p in u.params]


def _released(eng) -> dict:
    """What a step left: the storage bytes of every shard, the unit files' sizes and the expected ones."""
    off = eng.sharding.param_offload
    ws = torch.distributed.get_world_size()
    with torch.no_grad():
        storages = _storage_bytes(eng)
    files = {p.name: p.stat().st_size for p in off.directory.iterdir()}
    expected = {off._file(u.index).name: _expected_file_bytes(u, ws) for u in off.units
                if _expected_file_bytes(u, ws)}
    return {"storage_bytes": storages, "files": files, "expected_files": expected,
            "resident": off.resident_elements(), "units": len(off.units),
            "memory_params": sum(t.untyped_storage().nbytes() for t in eng.sharding.model_state_tensors()["params"])}


def _outside_forward(eng, base) -> dict:
    """Reads of the shards between steps (a module state dict, GatheredParameters, an evaluation forward)
    against the run without offload: they find the shards in memory, and the next zero_grad() releases
    them again without writing (the files still hold those bytes)."""
    import deepfleet.engine as deepspeed

    off = eng.sharding.param_offload
    written = off.bytes_written
    mine = {k: v.full_tensor() for k, v in eng.module.state_dict().items()}
    ref = {k: v.full_tensor() for k, v in base.module.state_dict().items()}
    out = {"state_dict_diff": max(float((mine[k] - ref[k]).abs().max()) for k in ref)}
    eng.zero_grad()
    out["released_after_state_dict"] = off.resident_elements()
    w, w_ref = eng.module.blocks[1].fc.weight, base.module.blocks[1].fc.weight
    with deepspeed.zero.GatheredParameters(w), deepspeed.zero.GatheredParameters(w_ref):
        out["gathered_diff"] = float((eng.module.blocks[1].fc.weight - base.module.blocks[1].fc.weight).abs().max())
    eng.zero_grad()  # GatheredParameters may change a shard: its unit is written
    out["written_after_gathered"] = off.bytes_written - written
    written = off.bytes_written
    with torch.no_grad():
        x, y = batch(99, torch.distributed.get_rank())
        out["eval_diff"] = abs(float(eng(x, y)) - float(base(x, y)))
    out["resident_after_eval"] = off.resident_elements()
    eng.zero_grad()
    out["resident_after_zero_grad"] = off.resident_elements()
    out["written_by_eval"] = off.bytes_written - written
    out["total_elements"] = sum(u.elements for u in off.units)
    out["unit_elements"] = [u.elements for u in off.units]
    # a training micro-step: each block's shards leave memory as its forward ends and come back for its
    # backward; the root's stay (FSDP2 keeps the root gathered through backward)
    loss = eng(x, y)
    out["resident_after_forward"] = off.resident_elements()
    eng.backward(loss)
    out["resident_after_backward"] = off.resident_elements()
    grads = {n: p.grad.full_tensor() for n, p in eng.module.named_parameters()}
    base_loss = base(x, y)
    base.backward(base_loss)
    ref = {n: p.grad.full_tensor() for n, p in base.module.named_parameters()}
    out["grad_diff"] = max(float((grads[n] - ref[n]).abs().max()) for n in ref)
    return out


def losses_run(rank: int, world_size: int, root: str) -> dict:
    base = engine(config())
    out: dict = {"base": train(base, range(STEPS)),
                 "base_bf16": train(engine(config(bf16=True)), range(STEPS)),
                 "base_gas": train(engine(config(gas=2)), range(2 * STEPS))}
    variants = (("param", {}), ("both", {"optimizer": True}), ("param_bf16", {"bf16": True}),
                ("param_ckpt", {"ckpt": True}), ("param_gas", {"gas": 2}))
    for name, kw in variants:
        pdir, odir = Path(root) / f"{name}-p", Path(root) / f"{name}-o"
        os.makedirs(pdir, exist_ok=True)
        os.makedirs(odir, exist_ok=True)
        eng = engine(config(params=str(pdir), optimizer=str(odir) if kw.get("optimizer") else None,
                            bf16=kw.get("bf16", False), ckpt=kw.get("ckpt", False), gas=kw.get("gas", 1)))
        per_step = kw.get("gas", 1)  # micro-steps per optimizer step
        before = {"files": sorted(p.name for p in eng.sharding.param_offload.directory.iterdir()),
                  "storage_bytes": _storage_bytes(eng)}
        losses, after = [], []
        for s in range(STEPS):
            losses += train(eng, range(per_step * s, per_step * (s + 1)))
            after.append(_released(eng))
        off = eng.sharding.param_offload
        out[name] = {"losses": losses, "before": before, "after": after, "read": off.bytes_read,
                     "written": off.bytes_written, "order": list(off.order)}
        if name == "param":
            out[name]["outside"] = _outside_forward(eng, base)
        if kw.get("optimizer"):
            out[name]["optimizer_state_in_memory"] = sum(len(s) for s in eng.optimizer.state.values() if s)
            out[name]["optimizer_files"] = eng.sharding.offloaded_optimizer_bytes()
    kept_dir = Path(root) / "kept"
    os.makedirs(kept_dir, exist_ok=True)
    cfg = config(params=str(kept_dir))
    root_elements = out["param"]["outside"]["unit_elements"][0]
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = root_elements  # the root unit fits, no block does
    eng = engine(cfg)
    out["kept"] = {"losses": train(eng, range(STEPS)), "after": _released(eng),
                   "persistent": [u.persistent for u in eng.sharding.param_offload.units],
                   "root_elements": root_elements}
    return out


def resume_run(rank: int, world_size: int, root: str) -> dict:
    pdir, odir, ckpt = Path(root) / "p", Path(root) / "o", str(Path(root) / "ckpt")
    for d in (pdir, odir):
        os.makedirs(d, exist_ok=True)
    cfg = config(params=str(pdir), optimizer=str(odir))
    eng = engine(cfg)
    first = train(eng, range(SAVE_AT))
    eng.save_checkpoint(ckpt, tag="t")
    after_save = _released(eng)  # saving pages the shards in and out again
    rest = train(eng, range(SAVE_AT, STEPS))

    resumed = engine(cfg)
    resumed.load_checkpoint(ckpt, tag="t")
    after_load = _released(resumed)  # before its first forward: still in memory (FSDP2's lazy init)
    continued = train(resumed, range(SAVE_AT, SAVE_AT + 1))
    after_first_step = _released(resumed)
    continued += train(resumed, range(SAVE_AT + 1, STEPS))

    # A write that fails half-way: the first unit file of the step lands, the second one's write puts
    # half its bytes in the .tmp and raises (a disk that filled up, a process killed mid-write).
    victim = engine(cfg)
    victim.load_checkpoint(ckpt, tag="t")
    train(victim, range(SAVE_AT, SAVE_AT + 1))
    off = victim.sharding.param_offload
    files = sorted(off.directory.glob("unit*.bin"))
    before_fail = {p.name: p.read_bytes() for p in files}
    real = os.pwrite
    files_seen: list[str] = []

    def failing(fd: int, data, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "deepfleet-params" not in path:  # the optimizer offload's files
            return real(fd, data, offset)
        if path not in files_seen:
            files_seen.append(path)
        if len(files_seen) == 1:
            return real(fd, data, offset)
        real(fd, bytes(data)[: len(data) // 2], offset)
        raise OSError(28, "No space left on device")

    os.pwrite = failing
    try:
        train(victim, range(SAVE_AT + 1, SAVE_AT + 2))
        raised = None
    except OSError as e:
        raised = str(e)
    finally:
        os.pwrite = real
    after_fail = {p.name: p.read_bytes() for p in sorted(off.directory.glob("unit*.bin"))}
    tmp = sorted(p.name for p in off.directory.glob("*.tmp"))
    kept_resident = [u.index for u in off.units if u.resident]

    again = engine(cfg)  # same directory: the killed run's files are cleared, never read
    leftovers = sorted(p.name for p in again.sharding.param_offload.directory.iterdir())
    again.load_checkpoint(ckpt, tag="t")
    after_kill = train(again, range(SAVE_AT, STEPS))
    return {
        "uninterrupted": first + rest, "continued": continued, "after_kill": after_kill,
        "after_save": after_save, "after_load": after_load, "after_first_step": after_first_step,
        "raised": raised, "changed_files": sorted(n for n in before_fail if after_fail.get(n) != before_fail[n]),
        "files_before_fail": sorted(before_fail), "files_after_fail": sorted(after_fail), "tmp": tmp,
        "kept_resident": kept_resident, "leftovers": leftovers,
    }
