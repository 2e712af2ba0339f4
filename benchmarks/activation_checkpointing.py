"""Activation checkpointing on the CPU: step-time cost and activation bytes of each block choice.

Run: `python benchmarks/activation_checkpointing.py [--quick]`; prints one JSON line per variant and a
summary line. Variants on the peer GPT (examples/gpt, 8 blocks): none, every block, every 2nd block,
selective (keep matmul and attention outputs), and every block with host offload of the checkpoint
inputs. Each variant applies its choices through `apply_block_choices` (the seam the config section and
the planner use). Step time is the median of timed forward + backward passes (one thread; runs of the
variants are interleaved so machine noise hits them alike); bytes come from
`deepfleet.engine.activation_memory.ActivationBytes` on a separate pass: `forward_bytes` is what the
forward keeps for backward (plus its output), `peak_bytes` the most live at any op over forward and
backward (recomputation and gradients included). On a CPU-only machine offload moves nothing (the
activations are host memory already), so its bytes equal "every block"'s; the line says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from deepfleet.engine.activation_checkpointing import BlockChoice, apply_block_choices  # noqa: E402
from deepfleet.engine.activation_memory import ActivationBytes  # noqa: E402
from deepfleet.engine.blocks import blocks  # noqa: E402
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens  # noqa: E402

LAYERS = 8
VARIANTS = {
    "none": [BlockChoice()] * LAYERS,
    "every_block": [BlockChoice("full")] * LAYERS,
    "every_2nd_block": [BlockChoice("full"), BlockChoice()] * (LAYERS // 2),
    "selective": [BlockChoice("selective")] * LAYERS,
    "every_block_cpu_offload": [BlockChoice("full", offload=True)] * LAYERS,
}


def build(name: str, cfg: GPTConfig) -> GPTWithLoss:
    torch.manual_seed(0)
    model = GPTWithLoss(cfg)
    apply_block_choices(blocks(model), VARIANTS[name])
    return model


def step(model: GPTWithLoss, batch: dict) -> float:
    loss = model(batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, seq_len=128, d_model=128 if args.quick else 256, n_heads=4, n_layers=LAYERS)
    micro = 4 if args.quick else 8
    repeats = 2 if args.quick else args.repeats
    data = SyntheticTokens(num_samples=micro, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    batch = {k: torch.stack([data[i][k] for i in range(micro)]) for k in ("input_ids", "labels")}
    models = {name: build(name, cfg) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses = {name: step(m, batch) for name, m in models.items()}  # warm-up, and the same loss everywhere
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, batch)
            times[name].append(time.perf_counter() - start)
    base_t = statistics.median(times["none"])
    lines = []
    for name, model in models.items():
        meter = ActivationBytes()
        with meter:
            loss = model(batch)
            meter.mark_forward()
            loss.backward()
        model.zero_grad(set_to_none=True)
        t = statistics.median(times[name])
        line = {"bench": "activation_checkpointing", "variant": name, "step_time_s": round(t, 4),
                "step_time_vs_none": round(t / base_t, 3), "forward_bytes": meter.forward_bytes,
                "peak_bytes": meter.peak_bytes, "loss": losses[name],
                "params": sum(p.numel() for p in model.parameters()),
                "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "seq_len": cfg.seq_len, "micro_batch": micro}}
        if name.endswith("cpu_offload"):
            line["note"] = "CPU-only run: the activations are host memory already, so offload moves nothing"
        lines.append(line)
        print(json.dumps(line), flush=True)
    base = lines[0]
    print(json.dumps({
        "bench": "activation_checkpointing_summary",
        "forward_bytes_vs_none": {ln["variant"]: round(ln["forward_bytes"] / base["forward_bytes"], 3) for ln in lines},
        "peak_bytes_vs_none": {ln["variant"]: round(ln["peak_bytes"] / base["peak_bytes"], 3) for ln in lines},
        "step_time_vs_none": {ln["variant"]: ln["step_time_vs_none"] for ln in lines},
        "same_loss": len({ln["loss"] for ln in lines}) == 1,
    }), flush=True)


if __name__ == "__main__":
    main()
