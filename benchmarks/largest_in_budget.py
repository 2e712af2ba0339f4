"""Largest model in a memory budget: per memory technique, the largest peer-GPT (`examples/gpt`) that
trains within a fixed per-rank budget on 2 gloo ranks, deepfleet beside the real DeepSpeed.

Techniques, each alone and one combination: plain data parallelism (ZeRO stage 0), ZeRO-1, ZeRO-2,
ZeRO-3, activation checkpointing (stage 0, every block), optimizer-state NVMe offload (at stage 1, the
least ZeRO that offload needs; files in a temporary directory) and ZeRO-3 + checkpointing + NVMe.

The model family is fixed: vocabulary, sequence length, heads and micro-batch stay put, and the model
grows first in depth (2..`--max-layers` blocks at d_model 64), then in width (d_model in steps of 32 at
`--max-layers` blocks), which orders the ladder by parameter count. For each technique:
1. the planner (`engine/planner`) proposes the largest rung whose estimated per-rank high-water mark
   fits (a binary search over the ladder; the profile's activations come from the meta-device probe,
   so no model is allocated to plan it; NVMe staging buffers count, host memory being the device here);
2. a real 2-rank run of 2 steps verifies it: the second step's high-water mark, measured with
   `engine/memory.py`'s `LiveStorages` (every storage alive, from the model state the engine holds plus
   every tensor the step's ops make), must be within the budget, else the next rung down is tried;
3. DeepSpeed 0.19.8 (`.venv-deepspeed`, see `benchmarks/setup_deepspeed.sh`) runs the same loop on the
   same rungs, measured the same way, starting at deepfleet's answer and moving by the ratio of budget
   to measured bytes until it brackets its own largest fitting rung. DeepSpeed has no config key for
   block checkpointing: its runs wrap each block in torch's non-reentrant checkpoint, what a
   DeepSpeed user writes in the model.

The measured step is the second, which at stage 0 holds a one-time transient the planner does not
model: torch's DDP rebuilds its gradient buckets in arrival order at the second forward, while the
first buckets still back the gradients (about 4 bytes per parameter more for that moment; measured at
12.3M parameters with checkpointing: 246.8 MB at step 2, 219.7 MB at step 3 against 219.9 MB planned).
A budget has to hold over the whole run, so the second step is the one that counts.

Prints one JSON line per technique (largest params, layers, d_model, planner bytes, measured bytes,
DeepSpeed's largest, or its error) and a summary line.

Usage: .venv/bin/python benchmarks/largest_in_budget.py --quick      (0.25 GiB per rank, a few minutes)
       .venv/bin/python benchmarks/largest_in_budget.py              (2 GiB per rank)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DS_VENV = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))  # benchmarks/setup_deepspeed.sh
sys.path.insert(0, str(ROOT))
WORLD = 2
GIB = 1024**3
VOCAB, SEQ, HEADS, MICRO = 512, 128, 4, 4
BUCKET = 2_000_000  # reduce/all-gather bucket elements, both engines
NVME_CHUNK = 1_000_000  # sub_group_size under NVMe offload: parameters per staged chunk
NVME_BUFFERS = 2


@dataclass(frozen=True)
class Technique:
    stage: int
    checkpoint: bool = False
    nvme: bool = False


TECHNIQUES = {
    "ddp": Technique(0),
    "zero1": Technique(1),
    "zero2": Technique(2),
    "zero3": Technique(3),
    "checkpointing": Technique(0, checkpoint=True),
    "nvme_optimizer": Technique(1, nvme=True),
    "zero3_checkpointing_nvme": Technique(3, checkpoint=True, nvme=True),
}


def ladder(max_layers: int, max_d_model: int) -> list[tuple[int, int]]:
    """(n_layers, d_model) rungs, smallest first: depth 2..max_layers at width 64, then wider."""
    rungs = [(n, 64) for n in range(2, max_layers + 1)]
    return rungs + [(max_layers, d) for d in range(96, max_d_model + 1, 32)]


def gpt_config(n_layers: int, d_model: int) -> Any:
    from examples.gpt.model import GPTConfig

    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=d_model, n_heads=HEADS, n_layers=n_layers)


def engine_config(t: Technique, *, impl: str, nvme_path: str | None) -> dict:
    """fp32 AdamW (torch's kernel in both engines) at the technique's stage, same buckets."""
    zero: dict = {"stage": t.stage, "reduce_bucket_size": BUCKET}
    if t.stage in (1, 2):
        zero["allgather_bucket_size"] = BUCKET  # read by stages 1 and 2 only
    if t.nvme:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": NVME_BUFFERS}
        zero["sub_group_size"] = NVME_CHUNK
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if t.checkpoint and impl == "deepfleet":
        cfg["deepfleet_activation_checkpointing"] = {"mode": "blocks", "every": 1}
    return cfg


def gpt_factory(n_layers: int, d_model: int) -> dict:
    """The planner's factory for one rung: the model and its synthetic data."""
    from examples.gpt.model import GPTWithLoss, SyntheticTokens

    return {"model": GPTWithLoss(gpt_config(n_layers, d_model)),
            "training_data": SyntheticTokens(num_samples=8, seq_len=SEQ, vocab_size=VOCAB)}


# ---- one verification run (every rank of a torchrun group) ----

def rank_run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.zero_stages import reachable_tensors
    from deepfleet.engine.memory import LiveStorages
    from examples.gpt.model import GPTWithLoss, SyntheticTokens

    torch.set_num_threads(1)
    t = TECHNIQUES[args.technique]
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import deepfleet.engine as deepspeed

        deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPTWithLoss(gpt_config(args.layers, args.d_model))
    if t.checkpoint and args.impl == "deepspeed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        blocks = model.gpt.blocks
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    params = sum(p.numel() for p in model.parameters())
    config = engine_config(t, impl=args.impl, nvme_path=args.nvme_path)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = SyntheticTokens(num_samples=MICRO * WORLD * 2, seq_len=SEQ, vocab_size=VOCAB, seed=1)

    def step(i: int) -> float:
        lo = (i * WORLD + rank) * MICRO
        batch = torch.utils.data.default_collate([data[j] for j in range(lo, lo + MICRO)])
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    losses = [step(0)]  # the first step allocates the optimizer state; the second is measured
    with LiveStorages() as live:
        # parameters, gradients, optimizer state, flat buffers; followed through in-place resizes
        # (FSDP2's gathered units and NVMe-offloaded shards change size without an op)
        live.track(reachable_tensors(engine), follow_resizes=True)
        if args.impl == "deepfleet":
            from deepfleet.engine.memory import _fsdp_unsharded, fsdp_modules, fsdp_resized_buffers

            fsdp = fsdp_modules(engine.sharding.module)
            for tensors in (*engine.sharding.model_state_tensors().values(), *_fsdp_unsharded(fsdp),
                            fsdp_resized_buffers(fsdp)):
                live.track(tensors, follow_resizes=True)
        start = live.current
        losses.append(step(1))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"peak": live.peak, "start": start})
    if rank == 0:
        print(json.dumps({"impl": args.impl, "params": params, "per_rank": gathered, "losses": losses}), flush=True)
    dist.destroy_process_group()


# ---- the driver ----

def _shim_path() -> Path:
    """A folder that makes `deepfleet.engine` importable in DeepSpeed's venv (where deepfleet is not
    installed), so its runs are measured by the same `LiveStorages` as ours."""
    shim = Path(tempfile.mkdtemp(prefix="largest-shim-"))
    (shim / "deepfleet").mkdir()
    (shim / "deepfleet" / "engine").symlink_to(ROOT / "engine")
    return shim


def measure(impl: str, technique: str, rung: tuple[int, int], *, nvme_root: Path, shim: Path | None,
            timeout: int) -> dict:
    """One 2-rank run of 2 steps; {"params", "measured" (the larger rank's peak), ...} or {"error"}."""
    layers, d_model = rung
    nvme = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=nvme_root))
    python = (DS_VENV if impl == "deepspeed" else ROOT / ".venv") / "bin" / "python"
    path = os.pathsep.join([str(ROOT), *([str(shim)] if impl == "deepspeed" and shim else [])])
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=path)
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(Path(__file__)), "--rank-run", "--impl", impl, "--technique", technique, "--layers", str(layers),
           "--d-model", str(d_model), "--nvme-path", str(nvme)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        # the ranks' own exception, not torchrun's ChildFailedError that wraps it
        errs = [m.group(0) for m in re.finditer(r"\b\w*(Error|Exception): .+", proc.stderr)
                if not m.group(0).startswith("ChildFailedError")]
        return {"error": (errs[0] if errs else proc.stderr[-300:]).strip()[:300]}
    out = json.loads(lines[-1])
    out["measured"] = max(r["peak"] for r in out["per_rank"])
    return out


def planner_bytes(technique: Technique, rung: tuple[int, int], *, nvme_path: str, cache: dict) -> float:
    """The planner's per-rank high-water mark for one rung (device total, NVMe staging buffers included)."""
    from deepfleet.engine.config import load_config
    from deepfleet.engine.planner.estimate import Choice, estimate
    from deepfleet.engine.planner.profile import profile_model

    if rung not in cache:
        cache[rung] = profile_model(gpt_factory, {"n_layers": rung[0], "d_model": rung[1]}, probe_device="meta")
    prof = cache[rung]
    cfg = load_config(engine_config(technique, impl="deepfleet", nvme_path=nvme_path), world_size=WORLD)
    choice = Choice(stage=technique.stage, offload_optimizer="nvme" if technique.nvme else "none",
                    checkpoint=tuple(range(len(prof.blocks))) if technique.checkpoint else ())
    est = estimate(prof, cfg, world_size=WORLD, choice=choice, micro_batch=MICRO)
    return est.device_total(host_is_device=True)


def planner_largest(technique: Technique, rungs: list[tuple[int, int]], budget: float, **kw: object) -> int | None:
    """Index of the largest rung the planner says fits (binary search: bytes grow along the ladder)."""
    if planner_bytes(technique, rungs[0], **kw) > budget:
        return None
    good, bad = 0, len(rungs)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if planner_bytes(technique, rungs[mid], **kw) <= budget else (good, mid)
    return good


def deepspeed_largest(name: str, rungs: list[tuple[int, int]], start: int, budget: float, *, params: dict,
                      runs: int, **kw: object) -> dict:
    """DeepSpeed's largest fitting rung, searched from `start` by the measured bytes-to-budget ratio."""
    fits: dict[int, float] = {}
    over: dict[int, float] = {}
    i = start
    for _ in range(runs):
        res = measure("deepspeed", name, rungs[i], **kw)
        if "error" in res:
            return {"deepspeed_error": res["error"], "deepspeed_rung_tried": list(rungs[i])}
        (fits if res["measured"] <= budget else over)[i] = res["measured"]
        lo = max(fits, default=-1)
        hi = min(over, default=len(rungs))
        if hi - lo == 1 or (lo == len(rungs) - 1) or (hi == 0):
            break
        # bytes grow about linearly with parameters: aim at the rung the ratio points to, inside the bracket
        target = params[rungs[i]] * budget / res["measured"]
        j = max((k for k in range(len(rungs)) if params[rungs[k]] <= target), default=0)
        i = min(max(j, lo + 1), hi - 1)
        if i in fits or i in over:
            i = lo + 1 if i == lo else hi - 1
    if not fits:
        return {"deepspeed_largest_params": None, "deepspeed_note": "no rung tried fits",
                "deepspeed_smallest_tried_bytes": min(over.values()) if over else None}
    best = max(fits)
    return {"deepspeed_largest_params": params[rungs[best]], "deepspeed_layers": rungs[best][0],
            "deepspeed_d_model": rungs[best][1], "deepspeed_measured_bytes": fits[best],
            "deepspeed_bracketed": best + 1 in over or best == len(rungs) - 1}


def param_count(rung: tuple[int, int]) -> int:
    layers, d = rung
    block = 12 * d * d + 13 * d  # qkv, proj, fc, out (weights and biases) and two LayerNorms
    return layers * block + VOCAB * d + SEQ * d + 2 * d + d * VOCAB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-run", action="store_true", help="(internal) one verification run on this rank group")
    ap.add_argument("--impl", choices=["deepfleet", "deepspeed"], default="deepfleet")
    ap.add_argument("--technique", choices=sorted(TECHNIQUES), default="ddp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--quick", action="store_true", help="budget 0.25 GiB per rank (default 2 GiB)")
    ap.add_argument("--budget-gib", type=float, default=None, help="per-rank budget (overrides --quick)")
    ap.add_argument("--max-layers", type=int, default=8)
    ap.add_argument("--max-d-model", type=int, default=4096)
    ap.add_argument("--techniques", default=",".join(TECHNIQUES), help="comma-separated subset")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--deepspeed-runs", type=int, default=None,
                    help="most DeepSpeed runs per technique (default 3 with --quick, else 5)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per verification run")
    args = ap.parse_args()
    if args.rank_run:
        rank_run(args)
        return
    ds_runs = args.deepspeed_runs or (3 if args.quick else 5)
    budget = (args.budget_gib if args.budget_gib is not None else 0.25 if args.quick else 2.0) * GIB
    rungs = ladder(args.max_layers, args.max_d_model)
    params = {r: param_count(r) for r in rungs}
    with_ds = not args.no_deepspeed and (DS_VENV / "bin" / "python").exists()
    nvme_root = Path(tempfile.mkdtemp(prefix="largest-nvme-"))
    shim = _shim_path() if with_ds else None
    try:
        lines = search(args, budget=budget, rungs=rungs, params=params, with_ds=with_ds, ds_runs=ds_runs,
                       nvme_root=nvme_root, shim=shim)
    finally:  # the offloaded optimizer state of every run is in files under nvme_root
        shutil.rmtree(nvme_root, ignore_errors=True)
        if shim:
            shutil.rmtree(shim, ignore_errors=True)
    ok = [ln for ln in lines if ln.get("largest_params")]
    print(json.dumps({
        "bench": "largest_in_budget_summary", "budget_bytes": budget, "world_size": WORLD,
        "family": {"vocab": VOCAB, "seq": SEQ, "heads": HEADS, "micro_batch": MICRO, "max_layers": args.max_layers},
        "largest_params": {ln["technique"]: ln["largest_params"] for ln in ok},
        "deepspeed_largest_params": {ln["technique"]: ln.get("deepspeed_largest_params") for ln in ok} if with_ds else None,
        "all_within_budget": all(ln["measured_bytes"] <= budget for ln in ok),
        "max_planner_error": max((abs(ln["planner_vs_measured"] - 1) for ln in ok), default=None),
        "best_technique": max(ok, key=lambda ln: ln["largest_params"])["technique"] if ok else None,
    }), flush=True)


def search(args: argparse.Namespace, *, budget: float, rungs: list[tuple[int, int]], params: dict, with_ds: bool,
           ds_runs: int, nvme_root: Path, shim: Path | None) -> list[dict]:
    """Every technique's line: the planner's answer, verified (and climbed past) by real runs, and
    DeepSpeed's largest on the same rungs; each line is printed as it is done."""
    profiles: dict = {}
    lines = []
    for name in args.techniques.split(","):
        t = TECHNIQUES[name]
        plan_kw = {"nvme_path": str(nvme_root), "cache": profiles}
        proposed = planner_largest(t, rungs, budget, **plan_kw)
        line: dict = {"bench": "largest_in_budget", "technique": name, "budget_bytes": budget, "stage": t.stage,
                      "checkpointing": t.checkpoint, "nvme_optimizer": t.nvme}
        if proposed is None:
            line["error"] = "the planner fits no rung of the ladder"
            print(json.dumps(line), flush=True)
            continue
        line["planner_proposed_params"] = params[rungs[proposed]]
        i, verified, tries = proposed, None, []
        run_kw = {"nvme_root": nvme_root, "shim": shim, "timeout": args.timeout}
        while i >= 0 and len(tries) < 4:
            res = measure("deepfleet", name, rungs[i], **run_kw)
            if "error" in res:
                line["error"] = res["error"]
                break
            tries.append({"params": res["params"], "measured_bytes": res["measured"]})
            if res["measured"] <= budget:
                verified = (i, res)
                break
            i -= 1
        if verified:
            # The planner errs both ways: where the measured bytes leave room for the next rung (scaled
            # by parameters), measure that one too, and keep climbing while it fits.
            i, res = verified
            climbs = 0
            while i + 1 < len(rungs) and climbs < 2 and res["measured"] * params[rungs[i + 1]] / params[rungs[i]] <= budget:
                climbs += 1
                up = measure("deepfleet", name, rungs[i + 1], **run_kw)
                if "error" in up:
                    break
                tries.append({"params": up["params"], "measured_bytes": up["measured"]})
                if up["measured"] > budget:
                    break
                i, res = i + 1, up
            layers, d_model = rungs[i]
            planned = planner_bytes(t, rungs[i], **plan_kw)
            line.update(largest_params=res["params"], layers=layers, d_model=d_model, planner_bytes=round(planned),
                        measured_bytes=res["measured"], planner_vs_measured=round(planned / res["measured"], 3),
                        losses=[round(x, 4) for x in res["losses"]], verify_runs=len(tries))
            if len(tries) > 1:
                line["other_runs"] = [tr for tr in tries if tr["params"] != res["params"]]
            if with_ds:
                if t.nvme and t.stage < 3:
                    line["deepspeed_note"] = ("DeepSpeed's stages 1 and 2 treat offload_optimizer device nvme as "
                                              "cpu: the state stays in host memory, no files")
                line.update(deepspeed_largest(name, rungs, i, budget, params=params, runs=ds_runs,
                                              **run_kw))
                ds = line.get("deepspeed_largest_params")
                if ds:
                    line["deepfleet_vs_deepspeed_params"] = round(res["params"] / ds, 3)
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
