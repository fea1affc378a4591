"""Export a DCP training checkpoint to one consolidated file for evaluation.

    python scripts/export_checkpoint.py runs/<run>/checkpoints/step_00001000 model.pt

The output is a ``torch.save`` dict ``{"model": state_dict, "config": resolved run config,
"step": step}``. Its state dict has ``nn.Linear``-compatible keys, so it loads into
``model.build_model(config["model"])`` with or without ``quant.quantize_model``. Runs in one
process on CPU, whatever the world size that wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.checkpoint import is_complete, read_extra  # noqa: E402


def export(checkpoint: Path, out: Path) -> Path:
    if not is_complete(checkpoint):
        raise ValueError(
            f"{checkpoint} is not a complete checkpoint (no COMPLETE marker or a truncated file). "
            f"Fix: pass a step_XXXXXXXX directory that training finished writing."
        )
    extra = read_extra(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint, full)
        state = torch.load(full, map_location="cpu", weights_only=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state["model"], "config": extra["config"], "step": extra["step"]}, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a step_XXXXXXXX checkpoint directory")
    p.add_argument("out", type=Path, help="output .pt file")
    a = p.parse_args()
    print(export(a.checkpoint, a.out))


if __name__ == "__main__":
    main()
