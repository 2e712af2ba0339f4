"""The multi-rank runs behind the ZeRO stage 1/2 tests (test_partitioned.py, test_partitioned_checkpoint.py).

Starting a rank costs seconds (torch import) on a shared box, so each world size (2 and 3) is spawned
once per test session and runs every scenario; the tests assert on the cached results. The 2-rank run
saves the checkpoints that the 3-rank run loads. Results come back as numpy arrays (`portable`).
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from deepfleet.engine import comm as engine_comm
from deepfleet.engine.zero.flat import chunks
from deepfleet.engine.zero.layout import all_gather_params, build_buckets
from tests.engine.partitioned_cases import (
    LR,
    STAGES,
    build,
    global_batch,
    make_model,
    portable,
    rank_slice,
    zero_config,
)
from tests.spawn import spawn

MICRO = 2  # samples per rank per micro-step
MAX_NORM = 0.05  # small enough that the test model really clips
RESUME_BATCH = 6  # divisible by 2 and 3 ranks


def _step(model, strategy, optimizer, batch, *, max_norm: float = 0.0) -> dict:
    model(batch).backward()
    overflow = strategy.finish_gradients(grad_scale=1.0)
    grads = {n: t.grad.to_local().clone() for n, t in zip(strategy._names, strategy._opt_tensors, strict=True)}
    norm = strategy.clip_grad_norm_(max_norm)
    optimizer.step()
    strategy.after_optimizer_step()
    strategy.zero_grad()
    return {
        "overflow": overflow,
        "norm": norm,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "grad_rows": grads,
        "rows": {s.name: (s.local_start, s.local_rows) for s in strategy._slots},
    }


def _one_step(rank: int, world_size: int, kind: str, stage: int, max_norm: float = 0.0) -> dict:
    model, strategy, optimizer = build(kind, stage)
    batch = rank_slice(global_batch(kind, MICRO * world_size), rank, world_size)
    return _step(model, strategy, optimizer, batch, max_norm=max_norm)


def _reinitialized(rank: int, world_size: int) -> dict:
    """The same model handed to a second stage-2 strategy trains as if the first never existed."""
    model = make_model("odd")
    STAGES[2](model, compute_dtype=torch.float32, zero_config=zero_config(2))
    strategy = STAGES[2](model, compute_dtype=torch.float32, zero_config=zero_config(2))
    optimizer = torch.optim.AdamW(
        strategy.optimizer_param_groups([{"params": list(model.parameters())}]), lr=LR, weight_decay=0.1
    )
    strategy.bind_optimizer(optimizer)
    return _step(
        model, strategy, optimizer, rank_slice(global_batch("odd", MICRO * world_size), rank, world_size)
    )


def _layout_round_trip(rank: int, world_size: int) -> bool:
    """Every rank keeps only its rows of odd-shaped tensors; one all-gather per bucket rebuilds them."""
    g = torch.Generator().manual_seed(7)
    shapes = [(1,), (5, 3), (7,), (), (4, 2, 3), (2,), (3, 1)]
    originals = [torch.randn(s, generator=g) for s in shapes]
    params = [torch.zeros(s) for s in shapes]
    named = [(f"t{i}", p) for i, p in enumerate(params)]
    buckets = build_buckets(named, bucket_numel=20, world_size=world_size, rank=rank)
    source = {id(p): o for p, o in zip(params, originals, strict=True)}
    for bucket in buckets:
        for p, slot in zip(bucket.params, bucket.slots, strict=True):
            src = source[id(p)]
            # this rank's rows only; every other row is garbage that the all-gather must overwrite
            p.fill_(float("nan"))
            p.view(slot.rows, slot.row_numel)[slot.local_start : slot.local_start + slot.local_rows] = (
                src.reshape(slot.rows, slot.row_numel)[slot.local_start : slot.local_start + slot.local_rows]
            )
        all_gather_params(bucket)
    return len(buckets) > 1 and all(torch.equal(p, o) for p, o in zip(params, originals, strict=True))


def _all_reduces() -> tuple[int, int]:
    """(count, bytes) of the all-reduces engine/comm.py has issued on this rank so far."""
    entry = engine_comm.counters().get("all_reduce")
    return (entry.count, entry.bytes) if entry is not None else (0, 0)


def _accumulate(rank: int, world_size: int, stage: int, local: bool = False, overlap: bool = False) -> dict:
    """Two micro-steps; `local` is stage 2's deepfleet_local_grad_accumulation. overlap_comm is off by
    default (DeepSpeed's default at stages 1/2; the step tests cover the async path); on, stage 1
    reduces during the boundary backward. `before_embedding` counts the all-reduces engine/comm.py had
    issued in the boundary backward when the token embedding's gradient (one of the last backward
    computes: the embedding is the first layer) was produced."""
    model, strategy, optimizer = build("gpt", stage, overlap=overlap, local_accumulation=local)
    batch = rank_slice(global_batch("gpt", 2 * MICRO * world_size), rank, world_size)
    halves = [{k: v[m * MICRO : (m + 1) * MICRO] for k, v in batch.items()} for m in range(2)]
    counts = []
    strategy.set_gradient_sync(False)
    with CommDebugMode() as comm:
        (model(halves[0]) / 2).backward()
    counts.append(comm.get_total_counts())
    strategy.set_gradient_sync(True)
    start = _all_reduces()
    before_embedding: list[int] = []
    hook = model.gpt.tok.weight.register_hook(lambda g: before_embedding.append(_all_reduces()[0] - start[0]))
    with CommDebugMode() as comm:
        (model(halves[1]) / 2).backward()
    counts.append(comm.get_total_counts())
    hook.remove()
    boundary_bytes = _all_reduces()[1] - start[1]
    full_grads_left = sum(p.grad is not None for p in model.parameters())
    with CommDebugMode() as comm:
        strategy.finish_gradients(grad_scale=1.0)
    counts.append(comm.get_total_counts())
    optimizer.step()
    strategy.after_optimizer_step()
    return {
        "counts": counts,
        "before_embedding": before_embedding,
        "boundary_bytes": boundary_bytes,
        "numel": sum(p.numel() for p in model.parameters()),
        "buckets": len(strategy._reduce_buckets),
        # stage 1 on gloo reduces param-major chunks in place (zero/flat.py), not rank-major buckets
        "chunks": sum(len(list(chunks(run.members, strategy._reduce_numel))) for run in strategy._param_runs),
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "full_grads_left": full_grads_left,
    }


def _overflow(rank: int, world_size: int, stage: int) -> dict:
    """Rank 1 gets one inf in a gradient row that rank 0 owns: after the reduction only rank 0 sees it
    locally, and every rank must still report the overflow."""
    model, strategy, _ = build("gpt", stage)
    head = model.gpt.head.weight
    if rank == 1:
        head.register_hook(
            lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf")))
        )
    model(rank_slice(global_batch("gpt", MICRO * world_size), rank, world_size)).backward()
    overflow = strategy.finish_gradients(grad_scale=1.0)
    local = [t.grad.to_local() for t in strategy._opt_tensors]
    return {"overflow": overflow, "local_finite": all(bool(torch.isfinite(g).all()) for g in local)}


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _memory(rank: int, world_size: int, stage: int) -> dict:
    model, strategy, optimizer = build("gpt", stage, bucket=50_000)
    model(rank_slice(global_batch("gpt", MICRO * world_size), rank, world_size)).backward()
    strategy.finish_gradients(grad_scale=1.0)
    optimizer.step()
    strategy.after_optimizer_step()
    tensors = strategy.model_state_tensors()
    moments = [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
        "numel": sum(p.numel() for p in model.parameters()),
        "optimizer": _storage_bytes(moments),
        "grads": _storage_bytes(tensors["grads"]),
        "params": _storage_bytes(tensors["params"]),
    }


def _bf16(rank: int, world_size: int, stage: int) -> dict:
    model, strategy, optimizer = build("gpt", stage, dtype=torch.bfloat16)
    batch = rank_slice(global_batch("gpt", MICRO * world_size), rank, world_size)
    out = _step(model, strategy, optimizer, batch)
    masters = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in strategy.state_dict()["model"].items()
    }
    out["masters"] = {k: masters[k] for k in out["params"]}
    out["dtypes"] = {
        "params": {str(p.dtype) for p in model.parameters()},
        "masters": {str(t.dtype) for t in strategy._opt_tensors},
        "grads": {str(t.dtype) for t in strategy._grad_segments},
    }
    # the 16-bit model is exactly the rounded master
    out["published"] = all(torch.equal(masters[k].to(torch.bfloat16), p) for k, p in model.named_parameters())
    return out


def _full_state(strategy) -> dict:
    sd = strategy.state_dict()

    def full(v):  # a copy: plain entries are views of live state that the next step changes
        return v.full_tensor() if isinstance(v, DTensor) else v.clone()

    return {
        "model": {k: full(v) for k, v in sd["model"].items()},
        "optim": {fqn: {k: full(v) for k, v in s.items()} for fqn, s in sd["optim"]["state"].items()},
        "groups": sd["optim"]["param_groups"],
    }


def _checkpoint(rank: int, world_size: int, case: str, path: str, save: bool) -> dict:
    """Save: stage 2 steps once and saves; load: a stage-1 model with other weights loads it. Both then
    take the same next step on the same global batch. `case` is a model kind, "-bf16" for 16-bit."""
    kind, _, precision = case.partition("-")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    fresh = None
    if save:
        model, strategy, optimizer = build(kind, 2, dtype=dtype)
        _step(model, strategy, optimizer, rank_slice(global_batch(kind, RESUME_BATCH), rank, world_size))
        dcp.save(strategy.state_dict(), checkpoint_id=path)
    else:
        model, strategy, optimizer = build(kind, 1, dtype=dtype, seed=1)
        before = [p.detach().clone() for p in model.parameters()]
        state = strategy.state_dict()  # before any step: the optimizer's state must exist to load into
        fresh = {
            "unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)),
            "steps": {float(s["step"]) for s in state["optim"]["state"].values()},
            "moments": {
                float(v.full_tensor().abs().sum())
                for s in state["optim"]["state"].values()
                for k, v in s.items()
                if isinstance(v, DTensor)
            },
        }
        dcp.load(state, checkpoint_id=path)
        strategy.load_state_dict(state)
    dist.barrier()
    loaded = _full_state(strategy)
    # every replica's model is the (rounded) loaded full-precision value
    published = all(torch.equal(loaded["model"][k].to(p.dtype), p) for k, p in model.named_parameters())
    batch = rank_slice(global_batch(kind, RESUME_BATCH, seed=2), rank, world_size)
    return {
        "state": loaded,
        "published": published,
        "fresh": fresh,
        "next": _step(model, strategy, optimizer, batch),
    }


def _load_at_stage_3(rank: int, world_size: int, path: str) -> dict:
    """FSDP2 (stage 3) loads the stage-2 checkpoint: the layouts agree, so the state is identical."""
    from deepfleet.engine.config_zero import ZeroConfig
    from deepfleet.engine.zero.fsdp import FSDPStrategy

    model = make_model("gpt", seed=1)
    user_groups = [{"params": list(model.parameters())}]  # read before fully_shard swaps the parameters
    strategy = FSDPStrategy(model, compute_dtype=torch.float32, zero_config=ZeroConfig(stage=3))
    groups = strategy.optimizer_param_groups(user_groups)
    strategy.bind_optimizer(torch.optim.AdamW(groups, lr=LR, weight_decay=0.1))
    state = strategy.state_dict()
    dcp.load(state, checkpoint_id=path)
    strategy.load_state_dict(state)
    return _full_state(strategy)


GROUPS_LR = 2e-3


def odd_param_groups(model) -> list[dict]:
    """Two groups with their own hyper-parameters; lin.bias is frozen (it rides along untouched)."""
    return [
        {"params": [model.b, model.c], "weight_decay": 0.0, "lr": GROUPS_LR},
        {"params": [model.lin.weight, model.lin.bias, model.a, model.s]},
    ]


def _groups(rank: int, world_size: int, stage: int) -> dict:
    model = make_model("odd")
    model.lin.bias.requires_grad_(False)
    strategy = STAGES[stage](model, compute_dtype=torch.float32, zero_config=zero_config(stage))
    try:
        strategy.optimizer_param_groups([{"params": [torch.zeros(3)]}])
        foreign = ""
    except ValueError as e:
        foreign = str(e)
    optimizer = torch.optim.AdamW(
        strategy.optimizer_param_groups(odd_param_groups(model)), lr=LR, weight_decay=0.1
    )
    strategy.bind_optimizer(optimizer)
    out = _step(
        model, strategy, optimizer, rank_slice(global_batch("odd", MICRO * world_size), rank, world_size)
    )
    groups = strategy.state_dict()["optim"]["param_groups"]
    out["groups"] = [(g["params"], g["lr"], g["weight_decay"]) for g in groups]
    out["foreign"] = foreign
    return out


def _own_process_group(rank: int, world_size: int, stage: int) -> dict:
    """`odd`'s `b` is rank-local, like an expert on an expert-parallel rank: its param group carries a
    process group of this rank alone, so it is reduced over that group (not averaged with the other
    ranks) while the rest is data-parallel over the default group."""
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    model = make_model("odd")
    strategy = STAGES[stage](model, compute_dtype=torch.float32, zero_config=zero_config(stage, bucket=12))
    dense = [p for n, p in model.named_parameters() if n != "b"]
    param_groups = [{"params": dense}, {"params": [model.b], "process_group": groups[rank]}]
    mapped = strategy.optimizer_param_groups(param_groups)
    optimizer = torch.optim.AdamW(mapped, lr=LR, weight_decay=0.1)
    strategy.bind_optimizer(optimizer)
    out = _step(
        model, strategy, optimizer, rank_slice(global_batch("odd", MICRO * world_size), rank, world_size)
    )
    group_of = {id(p): g for p, g in zip(strategy._params, strategy._groups_of, strict=True)}
    out["unmixed"] = all(group_of[id(p)] is b.group for b in strategy._reduce_buckets for p in b.params)
    out["b_bucket_size"] = [b.world_size for b in strategy._reduce_buckets if any(p is model.b for p in b.params)]
    out["keys"] = [sorted(k for k in g if k != "params") for g in mapped]
    return out


def engine_batches(world_size: int) -> list[dict[str, torch.Tensor]]:
    """Two global batches of 2 micro-steps x MICRO samples per rank."""
    return [global_batch("gpt", 2 * MICRO * world_size, seed=10 + step) for step in range(2)]


def _through_engine(rank: int, world_size: int, stage: int, overlap: bool = False) -> dict:
    """Two optimizer steps through `deepfleet.engine.initialize`: accumulation over 2 micro-steps,
    clipping, AdamW; the engine picks the stage's strategy from the config."""
    import deepfleet.engine as deepfleet

    model = make_model("gpt")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000,
                              "overlap_comm": overlap},
    }
    engine, *_ = deepfleet.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=0.1),
    )
    norms = []
    for batch in engine_batches(world_size):
        mine = rank_slice(batch, rank, world_size)
        for m in range(2):
            engine.backward(engine({k: v[m * MICRO : (m + 1) * MICRO] for k, v in mine.items()}))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return {
        "strategy": type(engine.sharding).__name__,
        "norms": norms,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
    }


def _fp16(rank: int, world_size: int, stage: int) -> dict:
    """fp16 through the engine: an inf injected into one rank's gradient (before the reduction, so
    at stage 2 too, where full gradients are freed during backward) skips the step on every rank."""
    import deepfleet.engine as deepfleet

    model = make_model("gpt")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
    }
    engine, *_ = deepfleet.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR),
    )
    poison = [False]
    if rank == world_size - 1:
        model.gpt.head.weight.register_hook(lambda g: g.fill_(float("inf")) if poison[0] else g)
    trace = []
    for step, overflow in enumerate([True, False, False]):
        poison[0] = overflow
        before = [p.detach().clone() for p in model.parameters()]
        engine.backward(
            engine(rank_slice(global_batch("gpt", MICRO * world_size, seed=20 + step), rank, world_size))
        )
        engine.step()
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
        trace.append({"changed": changed, "scale": float(engine.loss_scale), "skipped": engine.skipped_steps})
    return {"trace": trace, "dtype": str(model.gpt.head.weight.dtype)}


def _scenarios(rank: int, world_size: int, ckpt_dir: str) -> dict:
    out: dict = {"layout": _layout_round_trip(rank, world_size)}
    for stage in (1, 2):
        for kind in ("gpt", "odd"):
            out[f"step{stage}-{kind}"] = _one_step(rank, world_size, kind, stage)
        out[f"memory{stage}"] = _memory(rank, world_size, stage)
        if world_size == 3:
            out[f"clip{stage}"] = _one_step(rank, world_size, "gpt", stage, MAX_NORM)
            out[f"overflow{stage}"] = _overflow(rank, world_size, stage)
            out[f"engine{stage}"] = _through_engine(rank, world_size, stage)
            if stage == 1:  # the boundary reduced during backward (zero/boundary.py)
                out["engine1-overlap"] = _through_engine(rank, world_size, stage, overlap=True)
        else:
            out[f"accumulate{stage}"] = _accumulate(rank, world_size, stage)
            if stage == 2:
                out["accumulate2-local"] = _accumulate(rank, world_size, stage, local=True)
            else:
                out["accumulate1-overlap"] = _accumulate(rank, world_size, stage, overlap=True)
            out[f"bf16-{stage}"] = _bf16(rank, world_size, stage)
            out[f"groups{stage}"] = _groups(rank, world_size, stage)
            out[f"own-group{stage}"] = _own_process_group(rank, world_size, stage)
            out["reinitialized"] = _reinitialized(rank, world_size)
            out[f"fp16-{stage}"] = _fp16(rank, world_size, stage)
    for case in ("gpt", "odd", "gpt-bf16"):
        out[f"checkpoint-{case}"] = _checkpoint(rank, world_size, case, f"{ckpt_dir}/{case}", world_size == 2)
    if world_size == 3:
        out["stage3-load"] = _load_at_stage_3(rank, world_size, f"{ckpt_dir}/gpt")
    return portable(out)


@functools.cache
def scenario_runs() -> dict[int, list[dict]]:
    """Rank results by world size, computed once per session."""
    ckpt = tempfile.mkdtemp(prefix="zero12-")
    try:
        return {ws: spawn(_scenarios, ws, ckpt, timeout=600) for ws in (2, 3)}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
