"""Runs trainer configs under torchrun for tests/test_distributed.py (not a test itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_driver.py SPEC.json

SPEC holds ``{"runs": [{"overrides": [...], "exit_after_checkpoint": k or null}, ...]}``. Each run
composes configs/train.yaml with its overrides and trains in the shared process group. With
``exit_after_checkpoint`` every rank dies abruptly (``os._exit``) right after the checkpoint of
step k is complete: a job killed between steps, with no clean-up.
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import train  # noqa: E402
from training import checkpoint  # noqa: E402
from training.distributed import barrier, init_distributed, shutdown  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    di = init_distributed("cpu")
    for run in spec["runs"]:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=run["overrides"])
        kill_at = run.get("exit_after_checkpoint")
        if kill_at is not None:
            original = checkpoint.Checkpointer.save

            def save_then_die(self, step, *args, **kwargs):
                path = original(self, step, *args, **kwargs)
                if step == kill_at:
                    os._exit(137)
                return path

            checkpoint.Checkpointer.save = save_then_die
        train._train(cfg, di)
    barrier()  # as train.run: every rank is done before any tears the process group down
    shutdown()


if __name__ == "__main__":
    main()
