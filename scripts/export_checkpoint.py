"""Export a DCP training checkpoint to one consolidated file for evaluation.

    python scripts/export_checkpoint.py runs/<run>/checkpoints/step_00001000 model.pt
    python scripts/export_checkpoint.py runs/<run> model.pt      # its newest complete checkpoint

The first argument is a checkpoint directory (``step_XXXXXXXX``), or a run directory, whose
newest checkpoint under ``checkpoints/`` whose files match their checksums is exported (the one
``training.checkpoint.Checkpointer(run_dir / "checkpoints").newest_verified()`` names; the script
says which). A checkpoint that does not verify is refused with the reason. The output is a
``torch.save`` dict ``{"model": state_dict, "config": resolved run config, "step": step}``. Its
state dict has ``nn.Linear``-compatible keys, so it loads into ``model.build_model(config["model"])``
with or without ``quant.quantize_model``. Runs in one process on CPU, whatever the world size that
wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.checkpoint import Checkpointer, read_extra, verify


def _newest_in(checkpoints: Path) -> str:
    """A sentence naming the newest complete checkpoint in ``checkpoints``, or "" when none."""
    newest, _ = Checkpointer(checkpoints).newest_verified()
    return f" The newest complete checkpoint in {checkpoints} is {newest}." if newest else ""


def resolve_checkpoint(path: Path) -> Path:
    """The complete checkpoint directory that ``path`` names: ``path`` itself when it is one, or
    the newest complete checkpoint of the run directory ``path`` (in ``path/checkpoints/``).

    FileNotFoundError when ``path`` does not exist or a run directory has no complete
    checkpoint; ValueError when ``path`` is an incomplete checkpoint or neither kind of directory.
    Each message names the newest complete checkpoint nearby, when there is one.
    """
    usage = "pass runs/<run> (its newest complete checkpoint) or runs/<run>/checkpoints/step_XXXXXXXX"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist. Fix: {usage}.{_newest_in(path.parent)}")
    problem = verify(path)
    if problem is None:
        return path
    if (path / "checkpoints").is_dir():
        newest, _ = Checkpointer(path / "checkpoints").newest_verified()
        if newest is None:
            raise FileNotFoundError(
                f"the run directory {path} has no complete checkpoint in {path / 'checkpoints'} "
                f"(training saves one every train.ckpt_every steps and at the end). Fix: let the "
                f"run reach a checkpoint, or pass another run."
            )
        return newest
    if path.name.startswith("step_"):
        raise ValueError(
            f"{path} is not a complete checkpoint: {problem}. Fix: "
            f"{usage}, one that training finished writing.{_newest_in(path.parent)}"
        )
    raise ValueError(
        f"{path} is neither a checkpoint (step_XXXXXXXX with a COMPLETE manifest) nor a run "
        f"directory (with a checkpoints/ folder). Fix: {usage}.{_newest_in(path)}"
    )


def export(checkpoint: Path, out: Path) -> Path:
    """Write the model weights, resolved config and step of ``checkpoint`` (a checkpoint or a
    run directory, see :func:`resolve_checkpoint`) to ``out``; returns ``out``."""
    checkpoint = resolve_checkpoint(Path(checkpoint))
    extra = read_extra(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint, full)
        state = torch.load(full, map_location="cpu", weights_only=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state["model"], "config": extra["config"], "step": extra["step"]}, out)
    return out


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
