"""Validation loss of trained runs as an NVFP4 serving engine would run them (docs/export.md).

    python scripts/served_loss.py runs/<run> [runs/<run> ...] [--calib-batches 8] [--out table.md]

For each run (a run directory or checkpoint, resolved as scripts/export_hf.py does), on the run's own
validation set (``train.eval_batches`` × ``train.eval_batch_size``, the set its validation loss is
logged on), computed in FP32:

* ``trained``: the model as it trained (its scheme's quantized forward), the run's own validation loss;
* ``bf16``: the master weights unquantized (``scripts/export_hf.py --format hf``);
* ``w4a16``: the exported NVFP4 weights (``--format nvfp4``: the forward's Ŵ, or RTN PTQ for a run
  whose forward weights were BF16), activations unquantized;
* ``w4a4``: those weights, and every quantized linear's input quantized as vLLM's NVFP4 path does
  (RTN, 1×16 groups, a static global scale calibrated on ``--calib-batches`` validation batches;
  ``inference.served.vllm_activation_qdq``).

Prints a markdown table (and writes it to ``--out``). Bad input is one ``error:`` line and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from inference.nvfp4 import forward_weight_dtype, forward_weights  # noqa: E402
from inference.served import (  # noqa: E402
    MODES,
    calibrate_input_amax,
    served_model,
    trained_model,
    validation_batches,
)
from inference.trained_model import consolidate  # noqa: E402
from model.llama import build_model  # noqa: E402
from training.checkpoint import read_extra, resolve_checkpoint  # noqa: E402

FIX = ("Fix: --calib-batches no more than the split holds, or prepare the run's dataset on this machine "
       "(scripts/prepare_data.py with the run's data config).")


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean of the per-batch mean cross-entropies (as ``training.validation.Validation.loss``)."""
    return sum(float(model(x, y)) for x, y in batches) / len(batches)


def served_losses(source: Path, calib_batches: int) -> dict[str, object]:
    """The row of one run: its name, scheme, seed, and the loss of every mode of the module docstring."""
    checkpoint = resolve_checkpoint(source)
    world_size = (read_extra(checkpoint).get("fingerprint") or {}).get("world_size")
    blob = consolidate(checkpoint)
    state, config = blob["model"], blob["config"]
    cfg = build_model(config["model"], device="meta").config
    weights, _, ptq = forward_weights(state, cfg, config["quant"], forward_weight_dtype(config, world_size))
    trained = trained_model(state, config)
    amax = calibrate_input_amax(trained, weights, validation_batches(config, calib_batches, FIX))
    train = config["train"]
    evals = validation_batches(config, train["eval_batches"], FIX)
    row: dict[str, object] = {"run": config.get("run_name") or source.name, "scheme": config["quant"]["name"],
                              "seed": config.get("seed"), "step": blob.get("step"), "weights": "RTN PTQ" if ptq
                              else "forward Ŵ", "trained": mean_loss(trained, evals)}
    for mode in MODES:
        row[mode] = mean_loss(served_model(state, config, mode, weights, amax), evals)
    return row


def table(rows: list[dict[str, object]]) -> str:
    """The markdown table of ``rows`` (losses to 4 decimals; Δ against the run's trained forward)."""
    head = ("| run | scheme | seed | step | exported weights | trained forward | BF16 master | W4A16 | W4A4 "
            "| W4A16 − trained | W4A4 − trained |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['run']} | {r['scheme']} | {r['seed']} | {r['step']} | {r['weights']} | {r['trained']:.4f} "
             f"| {r['bf16']:.4f} | {r['w4a16']:.4f} | {r['w4a4']:.4f} | {r['w4a16'] - r['trained']:+.4f} "
             f"| {r['w4a4'] - r['trained']:+.4f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="run directories or step_XXXXXXXX checkpoints")
    p.add_argument("--calib-batches", type=int, default=8, help="validation batches that calibrate W4A4's scales")
    p.add_argument("--out", type=Path, help="also write the table here")
    a = p.parse_args(argv)
    try:
        if a.calib_batches < 1:
            raise ValueError(f"--calib-batches must be at least 1, got {a.calib_batches}")
        rows = [served_losses(run, a.calib_batches) for run in a.runs]
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    text = table(rows)
    print(text, end="")
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
