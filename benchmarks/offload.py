"""Offload benchmarks on the CPU: (1) training step time of the peer GPT (examples/gpt) at ZeRO stage 2
with the optimizer state offloaded to files (`offload_optimizer.device: nvme`, with and without the
read-ahead/background writes) vs no offload; (1b) the same at stage 3 with the parameter shards offloaded
to files (`offload_param.device: nvme`, alone and with the optimizer offload) vs no offload; (2) the CPU
Adam step: torch's fused and foreach AdamW,
deepfleet's `DeepSpeedCPUAdam` (engine/compat/adam.py) and DeepSpeed 0.19.8's `DeepSpeedCPUAdam` (its
JIT-built cpu_adam op, run in the DeepSpeed virtual environment when there is one).

Run alone: `python benchmarks/offload.py [--quick] [--nvme-dir DIR]`. One JSON line per measurement:
medians of interleaved rounds (machine noise hits every variant alike) and ratios to the baseline.
On a CPU-only machine the "NVMe" files sit on whatever disk holds `--nvme-dir` and RAM is the fast tier.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.optim_step import HP, gpt_shapes  # noqa: E402

DS_PYTHON = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed")) / "bin" / "python"


def _gpt_engine(zero: dict, d_model: int, layers: int):
    """The peer GPT on the engine with the `zero_optimization` section `zero` (the same model, data and
    optimizer for every variant)."""
    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss

    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "aio": {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1}}
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=8192, seq_len=64, d_model=d_model, n_heads=4, n_layers=layers))
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _engine(mode: str, nvme_dir: str, d_model: int, layers: int):
    zero: dict = {"stage": 2}
    if mode != "none":
        zero["sub_group_size"] = 1_000_000  # parameter elements per chunk file
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(Path(nvme_dir) / mode), "buffer_count": 4,
                                     "pipeline_read": mode == "nvme", "pipeline_write": mode == "nvme"}
    Path(nvme_dir, mode).mkdir(parents=True, exist_ok=True)
    return _gpt_engine(zero, d_model, layers)


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 8192, (8, 64), generator=g)}
    batch["labels"] = torch.roll(batch["input_ids"], -1, dims=1)
    return batch


def _time_steps(engines: dict, batch: dict, rounds: int, *, optimizer_offloaded: set[str]) -> tuple[dict, float]:
    """Median step seconds per variant over `rounds` interleaved rounds after a first untimed one (which
    creates the optimizer state and the first files), and the largest loss difference to "none"."""
    times: dict[str, list[float]] = {m: [] for m in engines}
    losses: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(rounds + 1):
        for m, e in engines.items():
            start = time.perf_counter()
            loss = e(batch)
            e.backward(loss)
            e.step()
            if m in optimizer_offloaded:
                e.sharding.offload.wait()  # the background writes belong to the step
            if r:
                times[m].append(time.perf_counter() - start)
            losses[m].append(float(loss.detach()))
    med = {m: statistics.median(v) for m, v in times.items()}
    diff = max(abs(a - b) for m in engines for a, b in zip(losses[m], losses["none"], strict=True))
    return med, diff


def _init_single_rank() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def bench_nvme(args: argparse.Namespace) -> None:
    _init_single_rank()
    modes = ("none", "nvme", "nvme-serial")
    d_model, layers = (256, 2) if args.quick else (512, 4)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        engines = {m: _engine(m, tmp, d_model, layers) for m in modes}
        med, diff = _time_steps(engines, _batch(), args.rounds, optimizer_offloaded={"nvme", "nvme-serial"})
        params = sum(p.numel() for p in engines["none"].sharding.module.parameters())
        files = engines["nvme"].sharding.offloaded_optimizer_bytes()
        print(json.dumps({
            "bench": "offload_nvme_step", "model": f"gpt d{d_model} L{layers}", "params": params, "stage": 2,
            "world_size": 1, "threads": torch.get_num_threads(), "step_s": {m: round(v, 4) for m, v in med.items()},
            "slowdown_vs_none": {m: round(v / med["none"], 3) for m, v in med.items()},
            "offloaded_mib": round(files / 2**20, 1),
            "max_loss_diff_vs_none": diff,
        }), flush=True)


def _stage3_engine(mode: str, nvme_dir: str, d_model: int, layers: int):
    zero: dict = {"stage": 3}
    path = str(Path(nvme_dir) / f"s3-{mode}")
    Path(path).mkdir(parents=True, exist_ok=True)
    if mode != "none":
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 2, "max_in_cpu": 0}
    if mode == "param+optimizer":
        zero["sub_group_size"] = 1_000_000
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": 4,
                                     "pipeline_read": True, "pipeline_write": True}
    return _gpt_engine(zero, d_model, layers)


def bench_param_nvme(args: argparse.Namespace) -> None:
    """Stage 3 (FSDP2, one rank): step time with the parameter shards in files between steps."""
    _init_single_rank()
    modes = ("none", "param", "param+optimizer")
    d_model, layers = (256, 2) if args.quick else (512, 4)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        engines = {m: _stage3_engine(m, tmp, d_model, layers) for m in modes}
        batch = _batch()
        med, diff = _time_steps(engines, batch, args.rounds, optimizer_offloaded={"param+optimizer"})
        params = sum(p.numel() for p in engines["none"].sharding.module.parameters())
        off = engines["param"].sharding.param_offload
        steps = args.rounds + 1
        read_mib = off.bytes_read / (steps - 1) / 2**20  # round 0 reads nothing back
        written_mib = off.bytes_written / steps / 2**20
        # shard bytes in memory at the end of forward, where activations peak (all of them without offload)
        e = engines["param"]
        loss = e(batch)
        at_forward_end = off.resident_elements() * 4
        e.backward(loss)
        e.zero_grad()
        print(json.dumps({
            "bench": "offload_param_nvme_step", "model": f"gpt d{d_model} L{layers}", "params": params, "stage": 3,
            "world_size": 1, "threads": torch.get_num_threads(), "step_s": {m: round(v, 4) for m, v in med.items()},
            "slowdown_vs_none": {m: round(v / med["none"], 3) for m, v in med.items()},
            "param_files_mib": round(off.file_bytes() / 2**20, 1),
            "resident_param_elements_between_steps": off.resident_elements(),
            "param_mib_in_memory_at_forward_end": {"none": round(params * 4 / 2**20, 1),
                                                   "param": round(at_forward_end / 2**20, 1)},
            "param_mib_read_per_step": round(read_mib, 1),
            "param_mib_written_per_step": round(written_mib, 1),
            "max_loss_diff_vs_none": diff,
        }), flush=True)


def _ds_cpu_adam(shapes: list[tuple[int, ...]], rounds: int) -> dict:
    """DeepSpeed's DeepSpeedCPUAdam step time, measured in the DeepSpeed venv (None with the reason if not)."""
    if not DS_PYTHON.exists():
        return {"error": f"no DeepSpeed venv at {DS_PYTHON}"}
    code = f"""
import json, statistics, time, torch
torch.set_num_threads(1)
from deepspeed.ops.adam import DeepSpeedCPUAdam
g = torch.Generator().manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in {shapes!r}]
for p in ps:
    p.grad = torch.randn(p.shape, generator=g) * 1e-2
opt = DeepSpeedCPUAdam(ps, lr={HP['lr']}, betas={HP['betas']}, eps={HP['eps']}, weight_decay={HP['weight_decay']},
                       adamw_mode=True)
opt.step()
t = []
for _ in range({rounds}):
    s = time.perf_counter(); opt.step(); t.append(time.perf_counter() - s)
print(json.dumps({{"step_s": statistics.median(t)}}))
"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run([str(DS_PYTHON), "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    except subprocess.TimeoutExpired:
        return {"error": "DeepSpeed's cpu_adam did not build/run within 20 minutes"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_cpu_adam(args: argparse.Namespace) -> None:
    from deepfleet.engine.compat.adam import DeepSpeedCPUAdam

    torch.set_num_threads(1)
    d, layers = (256, 4) if args.quick else (512, 8)
    shapes = gpt_shapes(d, layers)
    gen = torch.Generator().manual_seed(0)
    steps = {}
    for kind in ("foreach", "fused", "deepfleet_cpu_adam"):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        if kind == "deepfleet_cpu_adam":
            opt = DeepSpeedCPUAdam(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                                   weight_decay=HP["weight_decay"], adamw_mode=True)
        else:
            opt = torch.optim.AdamW(params, **HP, **{kind: True})
        opt.step()
        steps[kind] = opt.step
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            start = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    ds = _ds_cpu_adam(shapes, args.rounds)
    result = {"bench": "offload_cpu_adam", "params": sum(torch.Size(s).numel() for s in shapes), "threads": 1,
              "step_s": {k: round(v, 5) for k, v in med.items()}}
    if "step_s" in ds:
        result["step_s"]["deepspeed_cpu_adam"] = round(ds["step_s"], 5)
        result["speed_vs_deepspeed_cpu_adam"] = {k: round(ds["step_s"] / v, 3) for k, v in med.items()}
    else:
        result["deepspeed_cpu_adam"] = ds["error"]
    print(json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT, few rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--nvme-dir", default=None, help="directory for the offload files (default: the temp dir)")
    ap.add_argument("--only", choices=("nvme", "param_nvme", "cpu_adam"), default=None)
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.only in (None, "nvme"):
        bench_nvme(args)
    if args.only in (None, "param_nvme"):
        bench_param_nvme(args)
    if args.only in (None, "cpu_adam"):
        bench_cpu_adam(args)


if __name__ == "__main__":
    main()
