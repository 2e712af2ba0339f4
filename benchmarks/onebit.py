"""Compressed communication on 2 ranks: wire bytes and step time of Adam, 1-bit Adam, 0/1 Adam, 1-bit LAMB
and Adam with int8 gradient reduction (`communication`), on plain loopback and on a bandwidth-limited link,
plus the loss curves of the four optimizers on the same data.

Run by `make bench` (benchmarks/run_all.py runs every script here) or alone:
    .venv/bin/python benchmarks/onebit.py [--rate 1gbit] [--steps 30] [--d-model 256] [--curve-steps 150]
Each (link, optimizer) run is 2 gloo ranks under torchrun on the example GPT (`examples/gpt/model.py`);
runs are interleaved over `--repeats` rounds and medians are taken. The 1-bit optimizers warm up for 5
steps; the timed steps are the ones after. Bytes per step are `StepMetrics.comm_bytes` (what
`engine/comm.py` counted this rank putting on the wire).

The limited link is a loopback shaped by `tc` (a token bucket at `--rate` whose queue holds 50 ms of
traffic, so bulk transfers queue instead of being dropped and retransmitted) inside a network
namespace this script creates with `ip netns` and deletes afterwards; it needs root (CAP_NET_ADMIN). Without
it, the shaped runs are reported as one JSON line with the reason and the rest still runs.

JSON lines: {"bench": "onebit", "link", "optimizer", "bytes_per_step", "bytes_vs_adam", "step_time_s",
"step_time_vs_adam"}; {"bench": "onebit_curve", "optimizer", "loss": [...], "final_loss_vs_adam"}.
Timing on a shared 2-core machine is noisy: compare the ratios measured within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
WARMUP = 5
RUNS = {
    "Adam": ("Adam", {"lr": 1e-3}, None),
    "OneBitAdam": ("OneBitAdam", {"lr": 1e-3, "freeze_step": WARMUP}, None),
    "ZeroOneAdam": ("ZeroOneAdam", {"lr": 1e-3, "var_freeze_step": WARMUP, "var_update_scaler": 2,
                                    "local_step_scaler": 4, "local_step_clipper": 4}, None),
    "OneBitLamb": ("OneBitLamb", {"lr": 1e-2, "freeze_step": WARMUP}, None),
    "Adam+int8": ("Adam", {"lr": 1e-3}, {"compression": "int8", "guard": {"interval": 0}}),
}


def _worker(args: argparse.Namespace) -> None:
    import torch

    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.set_num_threads(1)
    name, params, communication = RUNS[args.optimizer]
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=64, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    torch.manual_seed(0)
    model = GPTWithLoss(cfg)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": name, "params": params},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    if communication:
        config["communication"] = communication
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = engine.parallel.dp_rank
    data = SyntheticTokens(num_samples=args.steps * 4 * WORLD, seq_len=64, vocab_size=args.vocab, seed=1)
    metrics: list = []
    engine.sinks.append(metrics.append)
    times = []
    for s in range(args.steps):
        rows = data.tokens[(s * WORLD + rank) * 4:(s * WORLD + rank + 1) * 4]
        start = time.perf_counter()
        loss = engine({"input_ids": rows[:, :-1], "labels": rows[:, 1:]})
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        timed = slice(WARMUP + 1, None)
        print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                          "bytes_per_step": statistics.median(m.comm_bytes for m in metrics[timed]),
                          "step_time_s": statistics.median(times[timed])}), flush=True)


def _netns(rate: str) -> tuple[str | None, str]:
    """Create a namespace with a shaped loopback; returns (name, "") or (None, why not)."""
    if os.geteuid() != 0:
        return None, "needs root (CAP_NET_ADMIN) for ip netns and tc"
    if not (shutil.which("ip") and shutil.which("tc")):
        return None, "ip or tc (iproute2) is not installed"
    name = f"deepfleet-bench-{os.getpid()}"
    steps = [["ip", "netns", "add", name], ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
              "burst", "256kb", "latency", "50ms"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            return None, f"{' '.join(cmd)}: {proc.stderr.strip()}"
    return name, ""


def _run(args: argparse.Namespace, optimizer: str, netns: str | None) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", __file__,
           "--worker", "--optimizer", optimizer, "--steps", str(args.steps), "--d-model", str(args.d_model),
           "--layers", str(args.layers), "--vocab", str(args.vocab)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(json.dumps({"bench": "onebit", "optimizer": optimizer, "error": proc.stderr[-1500:]}), flush=True)
        return None
    return json.loads(lines[-1])


def _links(args: argparse.Namespace) -> None:
    netns, why = _netns(args.rate)
    links = {"loopback": None}
    if netns:
        links[f"shaped {args.rate}"] = netns
    else:
        print(json.dumps({"bench": "onebit", "link": f"shaped {args.rate}", "skipped": why}), flush=True)
    try:
        for link, ns in links.items():
            results: dict[str, list[dict]] = {name: [] for name in RUNS}
            for _ in range(args.repeats):  # interleaved rounds
                for name in RUNS:
                    out = _run(args, name, ns)
                    if out:
                        results[name].append(out)
            adam = results["Adam"]
            if not adam:
                continue
            adam_bytes = statistics.median(r["bytes_per_step"] for r in adam)
            adam_time = statistics.median(r["step_time_s"] for r in adam)
            for name, rs in results.items():
                if not rs:
                    continue
                b = statistics.median(r["bytes_per_step"] for r in rs)
                t = statistics.median(r["step_time_s"] for r in rs)
                print(json.dumps({"bench": "onebit", "link": link, "optimizer": name, "params": rs[0]["params"],
                                  "bytes_per_step": b, "bytes_vs_adam": round(b / adam_bytes, 5),
                                  "step_time_s": round(t, 4), "step_time_vs_adam": round(t / adam_time, 3)}),
                      flush=True)
    finally:
        if netns:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _curves(steps: int) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.engine.onebit.onebit_runs import runs

    out = runs(WORLD, steps, ("Adam", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"))
    adam = sum(out["Adam"]["loss"][-20:]) / 20
    for name, run in out.items():
        final = sum(run["loss"][-20:]) / 20
        print(json.dumps({"bench": "onebit_curve", "optimizer": name, "final_loss_last20": round(final, 4),
                          "final_loss_vs_adam": round(final / adam, 4),
                          "loss": [round(x, 4) for x in run["loss"]]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped loopback")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--curve-steps", type=int, default=150, help="0 skips the convergence curves")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="Adam", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    _links(args)
    if args.curve_steps:
        _curves(args.curve_steps)


if __name__ == "__main__":
    main()
