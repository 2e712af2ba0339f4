#!/usr/bin/env bash
# Prepared GPU check for the kernels: the `-m gpu` tests, then benchmarks/kernels.py (Triton vs eager
# torch vs torch.compile, with the targets checked). Run on a CUDA machine from the repo root:
#   bash benchmarks/gpu_check.sh [results.jsonl] [--quick]
# Needs torch with CUDA and triton (the `kernels` extra). TRITON_INTERPRET must be unset so Triton
# compiles for the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-benchmarks/kernels-gpu.jsonl}
QUICK=${2:-}
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # explicit, or Triton 3.9 warns (an error in pytest)
export DEEPFLEET_KERNELS=auto
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== gpu tests"
"$PY" -m pytest tests/kernels -m gpu -q -x -p no:cacheprovider
echo "== kernel benchmarks -> $OUT"
: > "$OUT"
"$PY" benchmarks/kernels.py --out "$OUT" $QUICK
echo "== targets"
grep '"target"' "$OUT" || true
