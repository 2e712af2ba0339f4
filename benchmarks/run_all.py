"""`make bench`: run the benchmarks and print one JSON line per measurement, with ratios.

ZeRO stages: each stage runs on 2 gloo ranks under torchrun, deepfleet and (when `.venv-deepspeed`
exists, see `benchmarks/setup_deepspeed.sh`) the real DeepSpeed interleaved per stage, each repeated
`--repeats` times so machine noise hits both alike. Summary lines give, per stage, deepfleet's
model-state bytes against the ZeRO theory (fp32 AdamW: stage 0 16P, stage 1 8P+8P/N, stage 2 4P+12P/N,
stage 3 16P/N), its step time relative to stage 0 measured in the same run, and its speed and loss
curve against DeepSpeed's, in wall seconds and in CPU seconds per step (on a shared machine the CPU
figure is the steadier one); a plain table of the same goes to stderr. The model is the 27.4M-parameter
GPT (`--model-size 27m`); `--stages` picks stages, and unknown options go to `zero_stages.py`
(e.g. `--steps 4 --warmup 1` for a short run). Other benchmark scripts in this folder run after, each printing its own lines
(`largest_in_budget.py` in its full mode: the largest GPT per memory technique in 2 GiB per rank, beside DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
DS_VENV = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))  # benchmarks/setup_deepspeed.sh
WORLD = 2


def theory_bytes(stage: int, params: int, world: int) -> float:
    p, n = params, world
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]


def run_stage(impl: str, stage: int, extra: list[str]) -> dict | None:
    python = (DS_VENV if impl == "deepspeed" else VENV) / "bin" / "python"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(ROOT / "benchmarks" / "zero_stages.py"), "--impl", impl, "--stage", str(stage), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(json.dumps({"bench": "zero_stage", "impl": impl, "stage": stage, "error": proc.stderr[-2000:]}))
        return None
    return json.loads(lines[-1])


def zero_stages(repeats: int, extra: list[str], *, stages: list[int]) -> None:
    impls = ["deepfleet"] + (["deepspeed"] if (DS_VENV / "bin" / "python").exists() else [])
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeats):
        for stage in stages:
            for impl in impls:
                res = run_stage(impl, stage, extra)
                if res:
                    print(json.dumps(res), flush=True)
                    runs.setdefault((impl, stage), []).append(res)

    def med(impl: str, stage: int, key: str = "step_time_median_s") -> float | None:
        rs = runs.get((impl, stage))
        return statistics.median(r[key] for r in rs) if rs else None

    base = med("deepfleet", 0)
    cpu_base = med("deepfleet", 0, "cpu_time_median_s")
    table = []
    for stage in stages:
        rs = runs.get(("deepfleet", stage))
        if not rs:
            continue
        r = rs[0]
        states = r["bytes_per_rank"][0].get("total")
        theory = theory_bytes(stage, r["params"], r["world_size"])
        t = med("deepfleet", stage)
        cpu = med("deepfleet", stage, "cpu_time_median_s")
        line = {
            "bench": "zero_stage_summary",
            "stage": stage,
            "params": r["params"],
            "model_state_bytes_rank0": states,
            "theory_bytes": theory,
            "bytes_vs_theory": round(states / theory, 4) if states else None,
            "bytes_by_category_rank0": r["bytes_per_rank"][0],
            "step_time_s": t,
            "step_time_vs_stage0": round(t / base, 3) if base else None,
            "cpu_time_s": cpu,
            "cpu_time_vs_stage0": round(cpu / cpu_base, 3) if cpu_base else None,
            "tokens_per_s": r["tokens_per_s"],
        }
        ds = med("deepspeed", stage)
        if ds:
            ds_run = runs[("deepspeed", stage)][0]
            line["deepspeed_step_time_s"] = ds
            line["speedup_vs_deepspeed"] = round(ds / t, 3)
            ds_cpu = med("deepspeed", stage, "cpu_time_median_s")
            line["deepspeed_cpu_time_s"] = ds_cpu
            line["cpu_speedup_vs_deepspeed"] = round(ds_cpu / cpu, 3)
            line["deepspeed_reachable_bytes_rank0"] = ds_run["bytes_per_rank"][0]["reachable"]
            line["max_loss_diff_vs_deepspeed"] = max(
                abs(a - b) for a, b in zip(r["losses"], ds_run["losses"], strict=True))
        print(json.dumps(line), flush=True)
        table.append(line)
    print_table(table)


def print_table(lines: list[dict]) -> None:
    """The step-time table (stderr, so stdout stays one JSON object per line)."""
    head = ("stage", "deepfleet s", "vs stage 0", "DeepSpeed s", "speedup", "cpu speedup", "bytes/theory")
    print(" | ".join(head), file=sys.stderr)
    for ln in lines:
        cells = (ln["stage"], ln["step_time_s"], ln["step_time_vs_stage0"], ln.get("deepspeed_step_time_s", "-"),
                 ln.get("speedup_vs_deepspeed", "-"), ln.get("cpu_speedup_vs_deepspeed", "-"), ln["bytes_vs_theory"])
        print(" | ".join(str(c) for c in cells), file=sys.stderr, flush=True)


def other_benchmarks() -> None:
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name in {"run_all.py", "zero_stages.py", "kernels.py"}:
            continue  # kernels.py needs a GPU (benchmarks/gpu_check.sh)
        proc = subprocess.run([str(VENV / "bin" / "python"), str(script)], cwd=ROOT, text=True,
                              capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=3600)
        for ln in proc.stdout.splitlines():
            if ln.startswith("{"):
                print(ln, flush=True)
        if proc.returncode != 0:
            print(json.dumps({"bench": script.stem, "error": proc.stderr[-2000:]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="Run deepfleet's benchmarks.")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["zero", "other"], default=None)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    ap.add_argument("--model-size", default="27m", help="passed to benchmarks/zero_stages.py")
    args, extra = ap.parse_known_args()
    if args.only in (None, "zero"):
        zero_stages(args.repeats, ["--model-size", args.model_size, *extra], stages=args.stages)
    if args.only in (None, "other"):
        other_benchmarks()


if __name__ == "__main__":
    sys.exit(main())
