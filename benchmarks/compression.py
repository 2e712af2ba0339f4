"""Compression on the example GPT: loss, size and CPU generation speed of W8A8, W4, 50% sparse, 2:4 and
a 12->6-layer distilled student, each against the uncompressed model trained the same number of steps.

Run by `make bench` (benchmarks/run_all.py runs every script here) or alone:
    .venv/bin/python benchmarks/compression.py [--pretrain 150] [--finetune 60] [--d-model 64]
One process, one thread. A 12-layer TinyGPT is trained on the synthetic counting task through the
engine (ZeRO 0, one rank); each variant then fine-tunes a copy with its `compression_training`
config (quantization-aware training / pruning from the trained weights, or layer reduction plus
logit and hidden-state distillation from the 12-layer teacher), and `redundancy_clean` exports it.
The uncompressed baseline fine-tunes the same number of steps without compression.

One JSON line per variant: `eval_loss` of the trained compressed model and of its exported model on
held-out sequences (they should agree), `bytes` of the exported model (parameters and buffers at
their storage size: int8 codes, packed int4, scales), `nonzero_fraction` of its weights, and
`tokens_per_s` of greedy generation through `init_inference` (the exported model loaded as it is: integer
codes, pruned widths; static KV cache, fp32 compute) and `tokens_per_s_no_cache` of the plain
re-run-the-window loop (`compression/generate.py`), with ratios to the uncompressed model measured in
the same run (generation timed interleaved, median of repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wq(bits: int, groups: int) -> dict:
    return {"shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": groups,
                                  "quantize_weight_in_forward": True},
            "different_groups": {"wq1": {"params": {"start_bits": bits, "target_bits": bits},
                                         "modules": ["blocks", "head"]}}}


def _sparse(pattern: str | None) -> dict:
    shared = {"enabled": True, "schedule_offset": 0, **({"block_pattern": pattern} if pattern else {})}
    return {"shared_parameters": shared,
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["blocks"]}}}


def variants(layers: int) -> dict[str, dict]:
    keep = list(range(1, layers, 2))
    return {
        "fp32": {},
        "w8a8": {"weight_quantization": _wq(8, 64), "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["blocks"]}}}},
        "w4": {"weight_quantization": _wq(4, 256)},
        "sparse50": {"sparse_pruning": _sparse(None)},
        "sparse_2of4": {"sparse_pruning": _sparse("2:4")},
        f"distilled_{layers}to{len(keep)}": {"layer_reduction": {
            "enabled": True, "keep_number_layer": len(keep), "module_name_prefix": "gpt.blocks",
            "teacher_layer": keep, "other_module_name": ["gpt.tok", "gpt.pos", "gpt.ln_f", "gpt.head"]}},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrain", type=int, default=150)
    ap.add_argument("--finetune", type=int, default=60)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    import deepfleet.engine as deepfleet
    from deepfleet.engine.compression.compress import init_compression, redundancy_clean
    from deepfleet.engine.compression.distill import Distiller
    from deepfleet.engine.compression.export import model_bytes, nonzero_fraction
    from deepfleet.engine.compression.generate import greedy_generate
    from deepfleet.engine.inference.engine import init_inference
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    seq, vocab, micro = 32, 128, 16
    gcfg = GPTConfig(vocab_size=vocab, seq_len=seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    train = SyntheticTokens(num_samples=4096, seq_len=seq, vocab_size=vocab, seed=0)
    held = SyntheticTokens(num_samples=256, seq_len=seq, vocab_size=vocab, seed=99)

    def batch_of(data, i: int) -> dict:
        rows = [data[(i * micro + j) % len(data)] for j in range(micro)]
        return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}

    class Distilled(torch.nn.Module):
        """The student's task loss plus distillation from the teacher (held outside the module tree)."""

        def __init__(self, student, distiller) -> None:
            super().__init__()
            self.student, self._distiller = student, (distiller,)

        def forward(self, batch: dict) -> torch.Tensor:
            d = self._distiller[0]
            t_logits = d.teacher_forward(batch["input_ids"])
            s_logits = self.student.gpt(batch["input_ids"])
            task = torch.nn.functional.cross_entropy(s_logits.flatten(0, 1), batch["labels"].flatten())
            return task + d.loss(s_logits, t_logits)

    def config(compression: dict) -> dict:
        return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}},
                **({"compression_training": compression} if compression else {})}

    def fit(model, compression: dict, steps: int, start: int) -> None:
        engine, *_ = deepfleet.initialize(model=model, config=config(compression))
        for i in range(steps):
            loss = engine(batch_of(train, start + i))
            engine.backward(loss)
            engine.step()

    @torch.no_grad()
    def eval_loss(model) -> float:
        model.eval()
        losses = [float(model(batch_of(held, i))) for i in range(len(held) // micro)]
        model.train()
        return statistics.fmean(losses)

    torch.manual_seed(0)
    teacher = GPTWithLoss(gcfg)
    t0 = time.perf_counter()
    fit(teacher, {}, args.pretrain, 0)
    pretrain_s = time.perf_counter() - t0

    prompts = torch.stack([held[i]["input_ids"][:8] for i in range(8)])  # (8 prompts, 8 tokens)
    new_tokens = 16
    results, exported = {}, {}
    for name, compression in variants(args.layers).items():
        t0 = time.perf_counter()
        if "layer_reduction" in compression:
            lr = compression["layer_reduction"]
            model = GPTWithLoss(GPTConfig(**{**gcfg.__dict__, "n_layers": lr["keep_number_layer"]}))
            init_compression(model, {"compression_training": compression}, teacher_model=teacher)
            distiller = Distiller(model.gpt, teacher.gpt, module_name_prefix="blocks", teacher_layer=lr["teacher_layer"],
                                  temperature=2.0, hidden_weight=1.0)
            before = eval_loss(model)
            # Layer reduction acts once, at init_compression; the student then trains on task + KD loss.
            fit(Distilled(model, distiller), {}, args.finetune, args.pretrain)
        else:
            model = GPTWithLoss(gcfg)
            model.load_state_dict(teacher.state_dict())
            before = None
            fit(model, compression, args.finetune, args.pretrain)
        trained_loss = eval_loss(model)
        if compression:
            redundancy_clean(model, {"compression_training": compression})
        results[name] = {"bench": "compression", "variant": name, "pretrain_steps": args.pretrain,
                         "finetune_steps": args.finetune, "eval_loss_trained": round(trained_loss, 4),
                         "eval_loss_exported": round(eval_loss(model), 4),
                         "bytes": model_bytes(model), "nonzero_fraction": round(nonzero_fraction(model), 4),
                         "train_s": round(time.perf_counter() - t0, 1)}
        if before is not None:
            results[name]["eval_loss_student_init"] = round(before, 4)
        exported[name] = model.gpt.eval()

    engines = {n: init_inference(gpt, dtype=torch.float32, max_out_tokens=seq, max_batch_size=prompts.shape[0])
               for n, gpt in exported.items()}
    times: dict[str, list[float]] = {n: [] for n in exported}
    plain: dict[str, list[float]] = {n: [] for n in exported}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every variant alike
        for name, gpt in exported.items():
            t0 = time.perf_counter()
            engines[name].generate(prompts, max_new_tokens=new_tokens)
            times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            greedy_generate(gpt, prompts, max_new_tokens=new_tokens, max_context=seq)
            plain[name].append(time.perf_counter() - t0)
    base = results["fp32"]
    base_tps = prompts.shape[0] * new_tokens / statistics.median(times["fp32"])
    for name, r in results.items():
        tps = prompts.shape[0] * new_tokens / statistics.median(times[name])
        r.update(tokens_per_s=round(tps, 1), speed_vs_fp32=round(tps / base_tps, 3),
                 tokens_per_s_no_cache=round(prompts.shape[0] * new_tokens / statistics.median(plain[name]), 1),
                 size_vs_fp32=round(r["bytes"] / base["bytes"], 4),
                 loss_vs_fp32=round(r["eval_loss_exported"] - base["eval_loss_exported"], 4),
                 pretrain_s=round(pretrain_s, 1))
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
