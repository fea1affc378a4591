"""Preemption: a stop request becomes a checkpoint at a step boundary all ranks agree on.

A request is either a signal to a training process (``SIGUSR1``, ``SIGTERM``), or the file
``PREEMPT`` in the run directory, which the Slurm templates' batch script creates when Slurm sends
it ``--signal=B:USR1@…`` before the time limit. After the checkpoint, rank 0 writes ``REQUEUE``;
the batch script sees it and requeues the job, which resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

STOP_FILE = "PREEMPT"
REQUEUE_FILE = "REQUEUE"


class PreemptionWatcher:
    def __init__(self, run_dir: Path, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.run_dir = Path(run_dir)
        self._signalled = False
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self._signalled = True

    def requested(self) -> bool:
        return self._signalled or (self.run_dir / STOP_FILE).exists()

    def clear(self) -> None:
        """Forget an old request (called by rank 0 when a run starts or resumes)."""
        for name in (STOP_FILE, REQUEUE_FILE):
            (self.run_dir / name).unlink(missing_ok=True)

    def close(self) -> None:
        """Restore the signal handlers that were in place before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def mark_requeue(self) -> None:
        (self.run_dir / REQUEUE_FILE).write_text("checkpointed on a stop request; requeue to resume\n")
