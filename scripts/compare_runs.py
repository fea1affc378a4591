"""Compare training runs of several schemes: final validation loss and loss gap to BF16.

    python scripts/compare_runs.py runs/c4_sweep                     # trainer run dirs
    python scripts/compare_runs.py --wandb my-team/nvfp4-c4-sweep    # a W&B project (API, online)
    python scripts/compare_runs.py runs/c4_sweep --plot gap.png --curves gap_curves.png --out report.md

Sources (any mix, deduplicated):

* a trainer run directory (``metrics.jsonl`` and/or ``summary.json``); its config is read from
  ``config.json`` (the trainer's resolved config), ``.hydra/config.yaml`` (Hydra's copy) or
  ``config.yaml``; model, scheme and seed can also come from its name
  (``<model>-<scheme>-<budget>-s<seed>``). Directories given on the command line are searched
  recursively (``checkpoints/`` and ``.submitit/`` are skipped);
* a W&B project, ``--wandb ENTITY/PROJECT``, through W&B's public API (needs an API key and
  network). An offline W&B run folder without its run directory is not read (its ``.wandb`` log
  is a private format): it is reported with the fix, ``wandb sync <folder>`` and then
  ``--wandb``.

Pairing: a run is compared with the BF16 runs (``--baseline``, default ``bf16``) of the same model
and the same token budget (the ``tokens`` of its summary; else tokens-per-parameter × non-embedding
parameters; else ``train.tokens_per_param``; else ``train.steps``). Runs of different budgets never
pair. With seeds on both sides, the gap is the mean over the seeds both have of (scheme − BF16);
without common seeds it is mean(scheme) − mean(BF16) and the table says "unpaired". ``n`` is the
number of seeds averaged. Scheme runs of a model and budget without a BF16 run are listed in their
own section, and so are runs without a final validation loss (unfinished or failed).

Outputs: the markdown report on stdout (and ``--out``), with the gap of the final validation loss
and, where the runs logged it, that of ``val/loss_bf16`` (the same weights with every linear in
BF16, column "gap, BF16 val"); a PNG of loss gap against tokens per
parameter (one panel per model size, one line per scheme, ``--plot``; by default
``loss_gap.png`` in the first run directory given, and the report's last lines name the file),
optionally a PNG of the gap
along training (``--curves``: validation loss of the scheme minus BF16's at the same steps), and
optionally ``--json``. ``--writeback`` writes into every paired run read through the API its whole
gap curve against its baseline (``val/loss_gap`` and ``val/loss_gap_rel`` against their own axis
``gap_step``) and ``loss_gap`` (and ``loss_gap_baseline``) in its summary; runs read from files
are skipped with a message.

The reading, pairing and reporting live in the package ``analysis``; this is its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis import (
    BASELINE,
    CompareError,
    collect_paths,
    collect_wandb_project,
    compare,
    markdown,
    plot_curves,
    plot_gaps,
    report_json,
    writeback,
)

CURVES = Path("loss_gap_curves.png")
"""``--curves`` without a file: this name, in the gap plot's default folder."""


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path,
                   help="run directories or directories of runs (a sweep's)")
    p.add_argument("--wandb", action="append", default=[], metavar="ENTITY/PROJECT",
                   help="read the runs of a W&B project through the API (repeatable)")
    p.add_argument("--baseline", default=BASELINE, help="scheme the gaps are taken against (default: bf16)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of loss gap vs tokens per parameter (default: loss_gap.png in the first "
                        "run directory given, else in the current directory)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--curves", type=Path, nargs="?", const=CURVES, default=None,
                   help="also plot the gap along training (default file: loss_gap_curves.png, beside "
                        "the gap plot's default)")
    p.add_argument("--out", type=Path, help="also write the markdown report to this file")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON")
    p.add_argument("--writeback", action="store_true",
                   help="write the gap curve and loss_gap into every paired run read through the API")
    a = p.parse_args(argv)
    if not a.paths and not a.wandb:
        p.error("give run directories (e.g. runs/c4_sweep) and/or --wandb ENTITY/PROJECT")
    home = a.paths[0] if a.paths and a.paths[0].is_dir() else Path(".")
    a.plot = a.plot or home / "loss_gap.png"
    a.curves = home / CURVES if a.curves is CURVES else a.curves
    try:
        runs, notes = collect_paths(a.paths)
        for project in a.wandb:
            runs += collect_wandb_project(project)
        report = compare(runs, a.baseline, notes)
        text = markdown(report)
        print(text)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text + "\n")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(report_json(report), indent=2) + "\n")
        paired = [r for r in report.rows if r.gap is not None]
        if not a.no_plot:
            if paired:
                print(f"loss-gap plot: {plot_gaps(report, a.plot)}")
            else:
                print(f"no loss-gap plot: no run has a matching {report.baseline} baseline")
        if a.curves is not None:
            if any(r.curve for r in paired):
                print(f"gap-curve plot: {plot_curves(report, a.curves)}")
            else:
                print("no gap-curve plot: no paired runs with validation losses at common steps")
        if a.writeback:
            if paired:
                writeback(paired)
            else:
                print("--writeback: nothing to write (no paired runs)")
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
