"""A stand-in for `deepfleet-worker` in controller tests: same inputs (DEEPFLEET_WORKER_SPEC and the
worker environment), same outputs (log lines, heartbeats to the controller, checkpoints with a
COMPLETE marker and `latest`, the exit-code contract), without torch, so a test runs in a second.

Behaviour comes from the spec's entrypoint args (so a job spec drives it):
  --steps N        optimizer steps to "train" (default 5)        --step-s S   seconds per step (0.05)
  --exit CODE      exit status after the last step (default 0)
  --fail-node I --fail-attempt A --fail-code C --fail-at-step K   node I of attempt A exits C at step K
  --child          start a grandchild in a new session (like torchrun's training processes)
  --no-export      write no exported model even when the spec asks for one (node 0 otherwise writes a
                   tiny safetensors file and its export.json on success, as worker/export.py does)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deepfleet.worker.rendezvous import resolve
from deepfleet.worker.spec import (
    EXPORT_MANIFEST,
    EXPORT_MODEL_FILE,
    ExportManifest,
    WorkerSpec,
    load_worker_spec,
)


def main() -> int:
    spec = load_worker_spec()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--fail-node", type=int, default=-1)
    p.add_argument("--fail-attempt", type=int, default=0)
    p.add_argument("--fail-code", type=int, default=76)
    p.add_argument("--fail-at-step", type=int, default=2)
    p.add_argument("--child", action="store_true")
    p.add_argument("--no-export", action="store_true")
    args = p.parse_args(spec.entrypoint.args)
    node = int(os.environ.get("DEEPFLEET_NODE_RANK", "0"))
    rdzv = resolve(spec, os.environ)  # port 0: node 0 would bind and publish in rdzv.port_file
    print(f"fake worker node {node} attempt {spec.attempt} rendezvous {rdzv.endpoint} {rdzv.port_file}", flush=True)
    if args.child:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ckpt = Path(spec.checkpoint.dir) if spec.checkpoint else None
    start = 0
    if ckpt is not None and (ckpt / "latest").exists():
        start = int((ckpt / "latest").read_text().removeprefix("global_step"))
        print(f"resuming from global_step{start}", flush=True)
    # The injected failure happens even when this node started late and resumed past its step from a
    # checkpoint the other nodes wrote meanwhile (it then fails at its first step, or at once).
    fails = node == args.fail_node and spec.attempt == args.fail_attempt
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_s)
        if fails and step >= args.fail_at_step:
            _await_checkpoint(ckpt)
            print(f"node {node} failing with {args.fail_code}", flush=True)
            return args.fail_code
        print(f"step {step} loss {1.0 / step:.4f}", flush=True)
        if node == 0 and spec.checkpoint is not None and spec.checkpoint.every_steps and step % spec.checkpoint.every_steps == 0:
            tag = ckpt / f"global_step{step}"
            tag.mkdir(parents=True, exist_ok=True)
            (tag / "COMPLETE").write_text("")
            (ckpt / "latest.tmp").write_text(tag.name)
            os.replace(ckpt / "latest.tmp", ckpt / "latest")
        if node == 0 and spec.heartbeat.url:
            body = {"step": step, "loss": 1.0 / step, "tokens_per_s": 1000.0 + step,
                    "last_complete_checkpoint": (ckpt / "latest").read_text() if ckpt and (ckpt / "latest").exists()
                    else None}
            req = urllib.request.Request(spec.heartbeat.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {spec.heartbeat.token}"})
            try:
                urllib.request.urlopen(req, timeout=2).close()
            except OSError as e:  # heartbeats are best effort, like the real worker's
                print(f"heartbeat failed: {e}", flush=True)
    if fails:
        _await_checkpoint(ckpt)
        print(f"node {node} failing with {args.fail_code}", flush=True)
        return args.fail_code
    print("done", flush=True)
    if node == 0 and args.exit == 0 and not args.no_export:
        _export(spec, ckpt)
    return args.exit


def _export(spec: WorkerSpec, ckpt: Path | None) -> None:
    """A two-float safetensors file (written by hand: no torch here) and its manifest."""
    out = spec.export_dir
    if out is None or ckpt is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tag = (ckpt / "latest").read_text() if (ckpt / "latest").exists() else "global_step0"
    header = json.dumps({"__metadata__": {"format": "pt", "deepfleet.job_id": spec.job_id},
                         "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    data = len(header).to_bytes(8, "little") + header + bytes.fromhex("0000803f00000040")  # [1.0, 2.0]
    (out / EXPORT_MODEL_FILE).write_bytes(data)
    manifest = ExportManifest(job_id=spec.job_id, attempt=spec.attempt, file=EXPORT_MODEL_FILE, checkpoint=tag,
                              dtype=spec.export.dtype if spec.export else "fp32", tensors=1, bytes=len(data),
                              sha256=hashlib.sha256(data).hexdigest())
    (out / EXPORT_MANIFEST).write_text(manifest.model_dump_json(exclude_none=True))


def _await_checkpoint(ckpt: Path | None, *, timeout_s: float = 30.0) -> None:
    """A failing node fails only once node 0 has committed a checkpoint (when the job checkpoints), so
    "the next attempt resumes from it" holds however the nodes' starts are skewed on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while ckpt is not None and not (ckpt / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
