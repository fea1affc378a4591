"""How a run stops before its last step, and what it tells the user to do next.

* A stop request (preemption or Ctrl-C, :mod:`training.preemption`), taken up at a step boundary:
  the run checkpoints (unless nothing is trained yet), then raises :class:`Preempted` (Slurm
  requeues the job) or :class:`Interrupted` (the message gives the command that resumes).
* Divergence: a step whose loss, gradient norm or a parameter is non-finite
  (:class:`training.step.NonFinite`) stops the run before that step is saved or logged, with a
  :class:`TrainingError` that names the newest good checkpoint and the command that resumes from
  it at half the learning rate.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from .checkpoint import Checkpointer
from .errors import Interrupted, Preempted, TrainingError
from .preemption import PreemptionWatcher


def command_line(*extra: str) -> str:
    """The command that started this run (Hydra's overrides), with ``extra`` overrides replacing
    those of the same keys; generic when the run was not started from the command line."""
    keys = {e.split("=", 1)[0] for e in extra}
    try:
        given = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") not in keys]
    except ValueError:  # no Hydra run: training.trainer.run(cfg) called from code
        return "python train.py <the same overrides> " + " ".join(shlex.quote(e) for e in extra)
    return " ".join(["python train.py", *(shlex.quote(o) for o in [*given, *extra])])


class Stops:
    """The stop handling of one run: ``save(step, force_sync)`` checkpoints and returns the path,
    ``say`` prints a line; ``lr`` and ``resume_with_changes`` are the run's ``optim.lr`` and
    ``resume_with_changes``, which the divergence fix adjusts."""

    def __init__(self, preemption: PreemptionWatcher, checkpoints: Checkpointer, *, is_main: bool,
                 save: Callable[[int, bool], Path], say: Callable[[str], None], lr: float,
                 resume_with_changes: list[str]) -> None:
        self.preemption, self.checkpoints, self.is_main = preemption, checkpoints, is_main
        self.save, self.say = save, say
        self.lr, self.resume_with_changes = lr, list(resume_with_changes)

    def stop(self, step: int) -> None:
        """Act on a stop request at the boundary before ``step``: checkpoint (unless nothing is
        trained yet), then raise Preempted (requeue) or Interrupted (Ctrl-C)."""
        self.preemption.acknowledge()
        reason = self.preemption.preempt_reason()
        path = self.save(step, True) if step > 0 else None
        if reason is not None:
            if self.is_main:
                self.preemption.mark_requeue()
            self.say(f"stop requested ({reason}): "
                     + (f"checkpointed step {step} to {path}" if path else "nothing trained yet")
                     + "; exiting for requeue")
            raise Preempted(step)
        raise Interrupted(
            f"stopped by Ctrl-C before step {step + 1}: "
            + (f"checkpointed step {step} to {path}" if path else "nothing was trained yet")
            + f". Resume with the same command: {command_line()}"
        )

    def diverged(self, step: int, problem: str) -> TrainingError:
        """The error of a run whose step ``step`` (0-based) went non-finite: ``problem`` says what."""
        good, _ = self.checkpoints.newest_verified()
        changes = sorted({*self.resume_with_changes, "optim.lr"})
        lower = [f"optim.lr={self.lr / 2:g}"]
        if good is not None:
            lower.append(f"resume_with_changes=[{','.join(changes)}]")
        return TrainingError(
            f"{problem} at step {step + 1}. The run stopped before saving or logging that step; the "
            f"newest good checkpoint is {good or 'none (no checkpoint yet)'}. Fix: "
            + (f"resume from it with half the learning rate: {command_line(*lower)}" if good else
               f"start again with half the learning rate: {command_line(*lower)}")
            + "; or check the data, or try quant=bf16 to see whether the quantization scheme is at fault."
        )
