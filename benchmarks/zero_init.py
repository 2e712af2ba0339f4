"""Peak host memory while building a model, with and without `deepspeed.zero.Init`, per rank.

Each mode runs in fresh processes (`--ranks` gloo ranks under torchrun, default 2), so the peak resident set of a rank
(`ru_maxrss`) minus its resident set just before construction is the memory the construction needed.
Under `Init` each module's parameters are partitioned as its `__init__` returns
(engine/zero/construction.py), so the peak is about the rank's share plus the largest module; without it,
the whole model. The ratio is reported against the whole-model build measured in the same run.

Usage: python benchmarks/zero_init.py [--ranks 2 --d-model 768 --layers 12 --vocab 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rank_main(args: argparse.Namespace) -> None:
    import torch

    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=256, d_model=args.d_model, n_heads=8, n_layers=args.layers)
    before = _rss_kib()
    if args.mode == "init":
        with deepspeed.zero.Init():
            model = TinyGPT(cfg)
    else:
        model = TinyGPT(cfg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(json.dumps({"mode": args.mode, "rank": int(os.environ.get("RANK", 0)), "params": params,
                      "peak_mib": (peak - before) / 1024}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mode", choices=["whole", "init"])
    args = parser.parse_args()
    if args.mode:
        rank_main(args)
        return
    rows = {}
    for mode in ("whole", "init"):
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), __file__,
             "--mode", mode, "--d-model", str(args.d_model), "--layers", str(args.layers), "--vocab", str(args.vocab)],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        rows[mode] = max(r["peak_mib"] for r in lines), lines[0]["params"]
    whole, params = rows["whole"]
    init, _ = rows["init"]
    print(f"model: {params / 1e6:.1f}M parameters, fp32 = {params * 4 / 2**20:.0f} MiB; {args.ranks} ranks")
    print(f"peak construction memory per rank: whole {whole:.0f} MiB, zero.Init {init:.0f} MiB, "
          f"ratio {init / whole:.2f}")


if __name__ == "__main__":
    main()
