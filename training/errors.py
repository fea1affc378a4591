"""How a run ends other than by finishing: the exceptions the trainer raises and train.py turns into
exit codes (1 for an error, 0 for a preemption that Slurm requeues, 130 for Ctrl-C)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A run stopped for a reason the user can act on; the message says what and how."""


class ConfigError(TrainingError, ValueError):
    """A setting that cannot work; the message names the key, its value and the fix."""


class Preempted(Exception):
    """The run checkpointed on a preemption request and exits so that Slurm can requeue it."""


class Interrupted(Exception):
    """The run checkpointed on Ctrl-C and stops; the message says how to resume."""
