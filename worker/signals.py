"""Preemption: SIGTERM or a notice file -> every rank agrees at the next step boundary -> checkpoint ->
exit 75 (PREEMPTED, resumable), within the grace period.

Callers: `worker/train.py` (the managed loop) and any user script that opts in (examples/gpt/train.py).
The signal handler only sets a flag; the decision is taken at a step boundary, where all ranks
all-reduce (MAX) their flag so they stop after the *same* step and take one consistent checkpoint.
Torch's elastic agent forwards SIGTERM to its workers and SIGKILLs them after its shutdown timeout,
which `worker/agent.py` sets to the grace period; the agent also watches the notice file itself (a
cloud spot/eviction notice is a file, or an HTTP poll that a sidecar turns into one) and then
terminates the group through the same path, so training processes started by the agent do not watch
the file. Hand-written: torch.distributed.elastic only forwards signals, it has no step-boundary
agreement or checkpoint-then-exit protocol.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from deepfleet.worker.spec import ExitCode, PreemptionSpec

# The agent sets this in every training process's environment; rank 0 writes the checkpoint tag
# there after a preemption checkpoint so the agent can tell "preempted, resumable" from "killed".
MARKER_ENV = "DEEPFLEET_PREEMPTED_MARKER"


class PreemptionWatcher:
    """Collects preemption notices on this rank and turns them into one agreed stop decision."""

    def __init__(
        self,
        spec: PreemptionSpec | None = None,
        *,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec or PreemptionSpec()
        self.signals = signals
        self._clock = clock
        self._noticed_at: float | None = None
        self.reason: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    # -- notices --------------------------------------------------------------------------------------
    def install(self) -> PreemptionWatcher:
        """Handle the preemption signals in this process (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record: checkpointing from inside a signal handler could interrupt a collective.
        self.notice(f"signal {signal.Signals(signum).name}")

    def notice(self, reason: str) -> None:
        """Record a preemption notice (the first one starts the grace period)."""
        if self._noticed_at is None:
            self._noticed_at = self._clock()
            self.reason = reason

    @property
    def noticed(self) -> bool:
        """Whether this rank has seen a notice (a signal, or the notice file existing now)."""
        if self._noticed_at is None and self.spec.notice_file and os.path.exists(self.spec.notice_file):
            self.notice(f"notice file {self.spec.notice_file}")
        return self._noticed_at is not None

    def remaining_s(self) -> float:
        """Seconds left of the grace period (the full period before any notice)."""
        if self._noticed_at is None:
            return self.spec.grace_period_s
        return self.spec.grace_period_s - (self._clock() - self._noticed_at)

    # -- the agreed decision -------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """Call at every step boundary on every rank: True on all ranks iff any rank saw a notice.

        One all_reduce(MAX) of a one-element flag over the default process group (skipped without one)."""
        local = self.noticed
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        import torch

        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
        if agreed and not local:
            self.notice("a peer rank's notice")
        return agreed


def mark_preempted(tag: str | None, *, environ: dict[str, str] | None = None) -> None:
    """After the preemption checkpoint (on rank 0): tell the agent the group stopped resumably."""
    path = (os.environ if environ is None else environ).get(MARKER_ENV)
    if path:
        Path(path).write_text(tag or "")


def exit_preempted() -> None:
    """Leave with the PREEMPTED exit code (75)."""
    raise SystemExit(int(ExitCode.PREEMPTED))
