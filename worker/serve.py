"""A serving worker: the process a ServingJob runs instead of training.

Called by `worker/cli.py` when the WorkerSpec carries `serve` (the controller compiles a ServingJob that
way). It builds the model with the entrypoint's factory (under the same job's-own-code rule as the
managed loop, `worker.train.import_factory`), loads the newest complete checkpoint under
`checkpoint.dir` into it with `deepfleet.engine.init_inference` (the local backend copied the named
training job's checkpoint there; Kubernetes and Azure ML mount it there read-only, and nothing here
writes into it), binds its listening socket itself (`serve_address`; port 0 takes a free port, so
there is no race for it), writes the endpoint's URL to `DEEPFLEET_ENDPOINT_FILE` when the backend gives
one (the local backend reports the job RUNNING from it), and serves `engine/inference/serve.py`'s app
under uvicorn until SIGTERM. A spec or checkpoint the user must fix prints one line and exits 64.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepfleet.worker.spec import (
    ENDPOINT_FILE_ENV,
    SERVE_PORT,
    ExitCode,
    FactoryEntrypoint,
    WorkerSpec,
    WorkerSpecError,
)

DEFAULT_ADDRESS = f"0.0.0.0:{SERVE_PORT}"  # a container's: the pod's or node's address, one well-known port


def _model_of(built: Any) -> Any:
    """The module inside what a factory returned: a ManagedJob's (or mapping's) `model`, or the module."""
    if isinstance(built, Mapping):
        return built["model"]
    return getattr(built, "model", built)


def build_engine(spec: WorkerSpec) -> Any:
    """The InferenceEngine `spec` asks for; raises WorkerSpecError or ValueError (the user's to fix)."""
    from deepfleet.engine.inference.engine import init_inference
    from deepfleet.worker.train import import_factory

    assert spec.serve is not None and spec.checkpoint is not None and isinstance(spec.entrypoint, FactoryEntrypoint)
    opts = spec.serve
    model = _model_of(import_factory(spec.entrypoint)(**spec.entrypoint.args))
    quant = None if opts.quant is None else {"weight": {"num_bits": opts.quant.num_bits,
                                                        "group_size": opts.quant.group_size}}
    engine = init_inference(model, dtype=opts.dtype, quant=quant, checkpoint=spec.checkpoint.dir,
                            max_batch_size=opts.max_batch_size, max_out_tokens=opts.max_out_tokens,
                            replace_with_kernel_inject=opts.replace_with_kernel_inject)
    if opts.compile:
        engine.compile()
    return engine


def _listen(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(128)
    return sock


def _report(url: str) -> None:
    """Write the URL to the backend's endpoint file (atomically: the backend never reads half a line)."""
    target = os.environ.get(ENDPOINT_FILE_ENV)
    if not target:
        return
    tmp = Path(target).with_suffix(".tmp")
    tmp.write_text(url + "\n")
    os.replace(tmp, target)


def run_serve(spec: WorkerSpec) -> int:
    """Serve until SIGTERM; returns the worker exit code."""
    try:
        engine = build_engine(spec)
    except WorkerSpecError as e:
        for line in e.errors:
            print(f"deepfleet-worker: invalid spec: {line}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    except ValueError as e:
        print(f"deepfleet-worker: cannot serve: {str(e).splitlines()[0]}", file=sys.stderr)
        return int(ExitCode.INVALID_SPEC)
    import uvicorn

    from deepfleet.engine.inference.serve import API_KEY_ENV, api_keys_from, create_app

    assert spec.serve is not None
    sock = _listen(spec.serve_address or DEFAULT_ADDRESS)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    # a serving job's `env` sets the key, from a secret (`secretRef`), never in the spec's text
    app = create_app(engine, model_name=spec.serve.model_name, api_keys=api_keys_from(os.environ.get(API_KEY_ENV)))
    print(f"deepfleet-worker: job {spec.job_id} serving {spec.checkpoint.dir if spec.checkpoint else ''} at "
          f"{url}/v1/completions", flush=True)
    _report(url)
    # The socket object itself, not `fd=`: uvicorn labels an fd's socket AF_UNIX, so accepted TCP
    # connections would miss TCP_NODELAY and each response would wait out the client's delayed ACK.
    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    return int(ExitCode.SUCCEEDED)
