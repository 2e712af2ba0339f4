"""Peak model-state memory per rank over whole optimizer steps: deepfleet vs ZeRO theory vs DeepSpeed.

One training script, two engines (as `benchmarks/zero_stages.py`): the same DeepSpeed-style loop on
deepfleet or on the real DeepSpeed (its own virtual environment, `.venv-deepspeed`), the same small
GPT, data and config (fp32 AdamW, reduce buckets of P/16 elements, gradient accumulation `--gas`).

Both engines are measured the same way: the bytes of every distinct tensor storage reachable from the
engine object (parameters, gradients, optimizer state, flat buffers; `zero_stages.reachable_bytes`),
sampled after every forward, after every parameter's gradient is accumulated (a post-accumulate-grad
hook: this sees reduce buckets while they fill), after every backward and after every `step()`; the
maximum over the measured steps is the peak. For deepfleet the engine's own high-water mark
(`engine/memory.py` `HighWater`, from the strategy's inventory plus probes inside its reductions) is
printed beside it.

Usage: torchrun --standalone --nproc-per-node 2 benchmarks/zero_memory.py --impl deepfleet --stage 2
`benchmarks/run_all.py` runs every stage for both engines and prints one summary line per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DS_VENV = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))  # benchmarks/setup_deepspeed.sh
sys.path.insert(0, str(ROOT))
WORLD = 2


def theory_bytes(stage: int, params: int, world: int) -> float:
    """fp32 AdamW: stage 0 16P; 1: 4P + 4P + 8P/N; 2: 4P + 12P/N; 3: 16P/N."""
    p, n = params, world
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]


def bench_config(stage: int, *, micro_batch: int, gas: int, bucket: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "steps_per_print": 10**9,
    }


def measure_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.zero_stages import reachable_bytes, start_rank
    from examples.gpt.model import SyntheticTokens

    deepspeed, cfg, model = start_rank(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    params = sum(p.numel() for p in model.parameters())
    config = bench_config(args.stage, micro_batch=args.micro_batch, gas=args.gas, bucket=params // 16)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    peak = [0]
    active = [False]

    def sample(*_: object) -> None:
        if active[0]:
            peak[0] = max(peak[0], reachable_bytes(engine))

    for p in engine.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(sample)
    data = SyntheticTokens(num_samples=args.micro_batch * world * args.gas * args.steps, seq_len=args.seq,
                           vocab_size=args.vocab, seed=1)
    own_peak = 0
    for step in range(args.steps):
        active[0] = step > 0  # the first step allocates optimizer state; measure steady steps
        for micro in range(args.gas):
            lo = ((step * args.gas + micro) * world + rank) * args.micro_batch
            batch = torch.utils.data.default_collate([data[i] for i in range(lo, lo + args.micro_batch)])
            loss = engine(batch)
            sample()
            engine.backward(loss)
            sample()
            engine.step()
            sample()
        if step > 0 and args.impl == "deepfleet":
            own_peak = max(own_peak, engine.peak_model_state_bytes)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"reachable_peak": peak[0], "highwater_peak": own_peak or None})
    if rank == 0:
        print(json.dumps({"bench": "zero_memory_rank", "impl": args.impl, "stage": args.stage, "gas": args.gas,
                          "world_size": world, "params": params, "per_rank": gathered}), flush=True)
    dist.destroy_process_group()


def run(impl: str, stage: int, gas: int, extra: list[str], *, timeout: int = 600) -> dict | None:
    venv = DS_VENV if impl == "deepspeed" else ROOT / ".venv"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    cmd = [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(Path(__file__)), "--rank-run", "--impl", impl, "--stage", str(stage), "--gas", str(gas), *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # A run that hangs (DeepSpeed waiting on a stale JIT-build lock is the usual one) is reported as
        # this stage's error and the driver goes on, instead of the exception ending every later row.
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        hint = " ".join(str(p) for p in stale_build_locks()) if impl == "deepspeed" else ""
        print(json.dumps({"bench": "zero_memory", "impl": impl, "stage": stage, "gas": gas,
                          "error": f"timed out after {timeout} s" + (f"; delete the stale lock(s) {hint}" if hint else ""),
                          "stderr": stderr[-1500:]}), flush=True)
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(json.dumps({"bench": "zero_memory", "impl": impl, "stage": stage, "gas": gas,
                          "error": proc.stderr[-1500:]}), flush=True)
        return None
    return json.loads(lines[-1])


def stale_build_locks() -> list[Path]:
    """`lock` files under torch's extension cache: one left by a killed build makes every later
    DeepSpeed start wait on it forever."""
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return sorted(cache.glob("**/lock")) if cache.is_dir() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-run", action="store_true", help="(internal) run one engine on this rank group")
    ap.add_argument("--impl", choices=["deepfleet", "deepspeed"], default="deepfleet")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--gas-list", default="1,4", help="driver: accumulation steps to run")
    args, extra = ap.parse_known_args()
    if args.rank_run:
        measure_rank(args)
        return
    impls = ["deepfleet"] + (["deepspeed"] if (DS_VENV / "bin" / "python").exists() else [])
    if "deepspeed" in impls and stale_build_locks():
        print(json.dumps({"bench": "zero_memory", "warning": "DeepSpeed may hang on these build locks; delete "
                          "them if no build is running: " + " ".join(map(str, stale_build_locks()))}), flush=True)
    shape = ["--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--d-model", str(args.d_model),
             "--layers", str(args.layers), "--vocab", str(args.vocab), "--seq", str(args.seq), *extra]
    for gas in (int(g) for g in args.gas_list.split(",")):
        for stage in range(4):
            results = {impl: run(impl, stage, gas, shape) for impl in impls}
            ours = results.get("deepfleet")
            if not ours:
                continue
            p, n = ours["params"], ours["world_size"]
            theory = theory_bytes(stage, p, n)
            peak = max(r["reachable_peak"] for r in ours["per_rank"])
            line = {"bench": "zero_memory", "stage": stage, "gas": gas, "params": p, "world_size": n,
                    "theory_bytes": theory, "theory_per_param": round(theory / p, 2),
                    "deepfleet_peak_bytes": peak, "deepfleet_per_param": round(peak / p, 2),
                    "deepfleet_vs_theory": round(peak / theory, 3),
                    "deepfleet_highwater_bytes": max(r["highwater_peak"] or 0 for r in ours["per_rank"])}
            ds = results.get("deepspeed")
            if ds:
                ds_peak = max(r["reachable_peak"] for r in ds["per_rank"])
                line.update(deepspeed_peak_bytes=ds_peak, deepspeed_per_param=round(ds_peak / p, 2),
                            deepfleet_vs_deepspeed=round(peak / ds_peak, 3))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
