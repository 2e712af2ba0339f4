#!/usr/bin/env bash
# Install the real DeepSpeed into its own virtual environment (.venv-deepspeed) for the side-by-side
# ZeRO benchmark. It is never a dependency of deepfleet. Its CPU ops compile on first use; this warms them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-deepspeed
.venv-deepspeed/bin/pip install -q torch==2.13.0
DS_BUILD_OPS=0 .venv-deepspeed/bin/pip install -q deepspeed==0.19.8 torch==2.13.0
DS_ACCELERATOR=cpu .venv-deepspeed/bin/ds_report | grep -i accelerator || true
