"""Stop requests: preemption and Ctrl-C become a checkpoint at a step boundary all ranks agree on.

A preemption request is a signal to a training process (``SIGUSR1``, ``SIGTERM``) or the file
``PREEMPT`` in the run directory, which the Slurm templates' batch script creates when Slurm sends
it ``--signal=B:USR1@…`` before the time limit. After the checkpoint, rank 0 removes ``PREEMPT``
and writes ``REQUEUE``; the batch script sees it and requeues the job, which resumes from that
checkpoint. A request is never cleared unseen: the batch script removes stale markers before it
starts the trainer, and the trainer installs its handlers before it imports anything heavy
(:func:`install_early`), so a request that arrives during start-up is acted on once training can
checkpoint.

Ctrl-C (``SIGINT``) asks for the same checkpoint without a requeue; a second Ctrl-C raises
``KeyboardInterrupt`` at once.

A rank stuck in a collective never reaches the step boundary. :meth:`PreemptionWatcher.start_watchdog`
watches for that: when a request has waited ``grace_s`` seconds without the loop taking it up
(:meth:`PreemptionWatcher.acknowledge`), the process writes ``REQUEUE`` and exits, so that the job
is requeued from its newest checkpoint instead of idling until the process-group timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

STOP_FILE = "PREEMPT"
REQUEUE_FILE = "REQUEUE"
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_early: dict[str, object] = {"preempt": None, "interrupts": 0}


def _early_handler(signum, frame) -> None:
    if signum == signal.SIGINT:
        _early["interrupts"] = int(_early["interrupts"]) + 1
        if int(_early["interrupts"]) > 1:
            raise KeyboardInterrupt
    else:
        _early["preempt"] = signal.Signals(signum).name


def install_early() -> None:
    """Record stop signals from the first moment of the process (call before heavy imports);
    :class:`PreemptionWatcher` takes the recorded requests over."""
    if threading.current_thread() is threading.main_thread():
        for sig in (*PREEMPT_SIGNALS, signal.SIGINT):
            signal.signal(sig, _early_handler)


class PreemptionWatcher:
    """Stop requests of one run (see the module docstring).

    ``interrupt_signal``: whether Ctrl-C is taken over (the trainer's command line does; a run
    inside another program, a test say, keeps that program's Ctrl-C)."""

    def __init__(self, run_dir: Path, signals: tuple[int, ...] = PREEMPT_SIGNALS,
                 interrupt_signal: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self._signalled: str | None = _early["preempt"]  # type: ignore[assignment]
        self._interrupts = int(_early["interrupts"])
        _early.update(preempt=None, interrupts=0)
        self._previous: dict[int, object] = {}
        self._acknowledged = threading.Event()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            if interrupt_signal:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle_interrupt)

    def _handle(self, signum, frame) -> None:
        self._signalled = signal.Signals(signum).name

    def _handle_interrupt(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        sys.stderr.write("\nCtrl-C: checkpointing at the end of this step, then stopping "
                         "(Ctrl-C again to stop at once, without saving)\n")

    def requested(self) -> bool:
        """Any stop request: preemption or Ctrl-C."""
        return self.preempt_reason() is not None or self.interrupted()

    def interrupted(self) -> bool:
        return self._interrupts > 0

    def preempt_reason(self) -> str | None:
        """``SIGTERM``/``SIGUSR1``/``the PREEMPT file``, or None without a preemption request."""
        if self._signalled:
            return self._signalled
        return f"the {STOP_FILE} file" if (self.run_dir / STOP_FILE).exists() else None

    def clear_requeue(self) -> None:
        """Forget a ``REQUEUE`` marker of an earlier incarnation (rank 0, when a run starts)."""
        (self.run_dir / REQUEUE_FILE).unlink(missing_ok=True)

    def acknowledge(self) -> None:
        """The loop has taken the request up (the watchdog stands down)."""
        self._acknowledged.set()

    def mark_requeue(self) -> None:
        """Rank 0, after the checkpoint: the request is consumed and the job asks to be requeued."""
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        (self.run_dir / REQUEUE_FILE).write_text("checkpointed on a stop request; requeue to resume\n")

    def start_watchdog(self, grace_s: float, on_expire: Callable[[str], None] | None = None,
                       poll_s: float = 1.0) -> None:
        """Exit for requeue when a preemption request waits ``grace_s`` without being taken up.

        ``on_expire(message)`` runs instead of the default (write ``REQUEUE``, print the message,
        ``os._exit(1)``, which also makes srun end the other ranks)."""

        def expire(message: str) -> None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / REQUEUE_FILE).write_text(message + "\n")
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            os._exit(1)

        action = on_expire or expire

        def watch() -> None:
            since: float | None = None
            while not self._closed.wait(poll_s):
                if self._acknowledged.is_set():
                    return
                reason = self.preempt_reason()
                if reason is None:
                    continue
                since = since or time.monotonic()
                if time.monotonic() - since >= grace_s:
                    action(
                        f"a stop request ({reason}) waited {grace_s:.0f} s without reaching a step "
                        f"boundary (a rank hung in a collective?): exiting for requeue from the "
                        f"newest checkpoint (parallel.stop_grace_s sets the wait)"
                    )
                    return

        self._watchdog = threading.Thread(target=watch, name="stop-request-watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        """Stop the watchdog and restore the signal handlers that were in place before."""
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
