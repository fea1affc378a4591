"""One line per job of a sweep as it starts and as it ends, printed by the process that launched
the sweep (``python train.py -m ...``), whichever launcher runs the jobs.

The jobs run elsewhere (submitit processes or Slurm jobs) and print into their own logs, so the
launching process watches the sweep directory instead: a job has started when its run directory
has a ``train.log``, and has ended when it has a ``summary.json`` written after that (or when its
``train.log`` ends with an error line). A Hydra callback (configs/train.yaml, ``hydra.callbacks``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepWatcher:
    """Polls ``sweep_dir`` for run directories and writes a line per start and per end."""

    def __init__(self, sweep_dir: Path, out: TextIO = sys.stdout) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.out = out
        self.started: dict[Path, float] = {}
        self.ended: set[Path] = set()
        self.t0 = time.time()

    def poll(self) -> None:
        """Report what changed since the last poll."""
        if not self.sweep_dir.is_dir():
            return
        for log in sorted(self.sweep_dir.glob("*/train.log")):
            run = log.parent
            if log.stat().st_mtime < self.t0 - 1:
                continue  # a run of an earlier sweep in the same directory
            if run not in self.started:
                self.started[run] = time.time()
                self._say(f"sweep: started {run.name} ({run})")
            if run in self.ended:
                continue
            summary = run / "summary.json"
            if summary.is_file() and summary.stat().st_mtime >= self.t0 - 1:
                self.ended.add(run)
                try:
                    loss = json.loads(summary.read_text()).get("final_val_loss")
                except ValueError:
                    loss = None
                result = f"final validation loss {loss:.4f}" if isinstance(loss, (int, float)) else "done"
                self._say(f"sweep: finished {run.name}: {result} ({time.time() - self.started[run]:.0f} s)")

    def finish(self) -> None:
        """The last poll, and a line for each job that started but never wrote its summary."""
        self.poll()
        for run in sorted(set(self.started) - self.ended):
            self._say(f"sweep: {run.name} ended without a summary (failed or stopped): see {run / 'train.log'}")
        self._say(f"sweep: {len(self.ended)} of {len(self.started)} job(s) finished; runs in {self.sweep_dir}")

    def _say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


class SweepProgress(Callback):
    """Hydra callback: watch the sweep directory while a multirun is under way."""

    def __init__(self, poll_s: float = 2.0) -> None:
        self.poll_s = poll_s
        self._watcher: SweepWatcher | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Launchers pickle the Hydra context, callbacks included, into each job: the watcher
        stays in the launching process."""
        return {"poll_s": self.poll_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._watcher = SweepWatcher(Path(str(config.hydra.sweep.dir)))
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                self._watcher.poll()

        self._thread = threading.Thread(target=loop, name="sweep-progress", daemon=True)
        self._thread.start()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._thread is None or self._watcher is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._watcher.finish()
        self._thread = self._watcher = None
