#!/usr/bin/env bash
# Install the real DeepSpeed into its own virtual environment ($DEEPSPEED_VENV, default .venv-deepspeed in
# the checkout; the side-by-side benchmarks look there) for the side-by-side benchmarks. It is never a dependency of deepfleet. Its CPU ops compile on first use; this warms them.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DEEPSPEED_VENV:-.venv-deepspeed}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
DS_BUILD_OPS=0 "$venv/bin/pip" install -q deepspeed==0.19.8 torch==2.13.0
DS_ACCELERATOR=cpu "$venv/bin/ds_report" | grep -i accelerator || true
