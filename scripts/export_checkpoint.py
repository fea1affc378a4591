"""Export a DCP training checkpoint to one consolidated file for evaluation.

    python scripts/export_checkpoint.py runs/<run>/checkpoints/step_00001000 model.pt
    python scripts/export_checkpoint.py runs/<run> model.pt      # its newest complete checkpoint

The first argument is a checkpoint directory (``step_XXXXXXXX``), or a run directory, whose
newest checkpoint under ``checkpoints/`` whose files match their checksums is exported (the one
``training.checkpoint.Checkpointer(run_dir / "checkpoints").newest_verified()`` names; the script
says which). A checkpoint that does not verify is refused with the reason. The output is
``training.checkpoint.export``'s ``torch.save`` dict ``{"model": state_dict, "config": resolved run
config, "step": step}``, which loads into ``model.build_model(config["model"])`` with or without
``quant.quantize_model``. Runs in one process on CPU, whatever the world size that wrote the
checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.checkpoint import export, resolve_checkpoint


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path,
                   help="a step_XXXXXXXX checkpoint directory, or a run directory (its newest "
                        "complete checkpoint is used)")
    p.add_argument("out", type=Path, help="output .pt file")
    a = p.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(a.checkpoint)
        if checkpoint != a.checkpoint:
            print(f"exporting {checkpoint}, the newest complete checkpoint of {a.checkpoint}")
        print(export(checkpoint, a.out))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
