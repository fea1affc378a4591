"""The command line of ``python train.py`` and ``nvfp4-train``: Hydra composes configs/train.yaml
with the overrides, the trainer runs it (:func:`training.trainer.run`), and how the run ended
becomes the exit code: 0 when it finished or checkpointed for a requeue (preemption), 1 for an
error (the message names the problem and the fix), 130 for Ctrl-C.

Importing this module registers train.yaml's run-name resolvers (:mod:`training.identity`), also
in the processes of a Hydra launcher, which import the task function from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from . import identity  # noqa: F401  (train.yaml's ${budget:...} and ${scheme_label:...})
from .errors import Interrupted, Preempted, TrainingError

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")
"""Hydra's config directory, beside this package in a checkout and in an installed copy alike."""


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Train as the composed ``cfg`` says (see the module docstring for the exit codes)."""
    from .stopping import command_line
    from .trainer import run, run_dir_of

    try:
        run(cfg, handle_ctrl_c=True)
    except Preempted:
        sys.exit(0)
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print(f"\nstopped at once (second Ctrl-C), without saving. Resume from the newest checkpoint "
              f"in {run_dir_of(cfg) / 'checkpoints'} with the same command: {command_line()}", file=sys.stderr)
        sys.exit(130)
    except (TrainingError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
