"""Runs trainer configs under torchrun for tests/test_distributed.py (not a test itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_driver.py SPEC.json

SPEC holds ``{"runs": [{"overrides": [...], "exit_after_checkpoint": k or null,
"count_collectives": k or null}, ...]}``. Each run composes configs/train.yaml with its overrides and
trains in the shared process group. With ``exit_after_checkpoint`` every rank dies abruptly
(``os._exit``) right after the checkpoint of step k is complete: a job killed between steps,
with no clean-up. With ``count_collectives`` each rank writes the bytes that the collectives of
its first k training steps moved (training/comm_bytes.py), summed, to
``<run_dir>/collectives-rank<r>.json``.
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from training import checkpoint, step, trainer
from training.comm_bytes import CollectiveBytes
from training.distributed import barrier, init_distributed, shutdown

REPO = Path(__file__).resolve().parents[1]


def _exiting_after(save: Callable[..., Any], kill_at: int) -> Callable[..., Any]:
    """``Checkpointer.save`` that ends the process (``os._exit(137)``) once step ``kill_at`` is saved."""

    def save_then_die(self: checkpoint.Checkpointer, step: int, *args: Any, **kwargs: Any) -> Any:
        path = save(self, step, *args, **kwargs)
        if step == kill_at:
            os._exit(137)
        return path

    return save_then_die


def _counting(call: Callable[..., Any], counter: CollectiveBytes, steps: int) -> Callable[..., Any]:
    """``TrainStep.__call__`` with the collectives of its first ``steps`` calls counted by ``counter``."""
    calls = [0]

    def counted(self: step.TrainStep, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > steps:
            return call(self, *args, **kwargs)
        with counter:
            return call(self, *args, **kwargs)

    return counted


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    di = init_distributed("cpu")
    for run in spec["runs"]:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=run["overrides"])
        kill_at = run.get("exit_after_checkpoint")
        if kill_at is not None:
            checkpoint.Checkpointer.save = _exiting_after(checkpoint.Checkpointer.save, kill_at)
        plain_step = step.TrainStep.__call__
        counter = CollectiveBytes()
        if run.get("count_collectives"):
            step.TrainStep.__call__ = _counting(plain_step, counter, run["count_collectives"])
        trainer.train(cfg, di)
        step.TrainStep.__call__ = plain_step
        if run.get("count_collectives"):
            out = Path(cfg.run_dir) / f"collectives-rank{di.rank}.json"
            out.write_text(json.dumps({"bytes": counter.bytes, "calls": counter.calls}))
    barrier()  # as trainer.run: every rank is done before any tears the process group down
    shutdown()


if __name__ == "__main__":
    main()
