"""Analysis of training runs: the loss gap of each scheme to BF16 (SPEC §5), read from trainer run
directories or a W&B project (through its public API). ``scripts/compare_runs.py`` is its command line.

Modules, one job each:

* :mod:`analysis.runs`: the :class:`Run` record; reading trainer run dirs and walking paths;
* :mod:`analysis.wandb_folders`: W&B run folders on disk, recognised (never decoded);
* :mod:`analysis.wandb_api`: runs of a W&B project through the API, and the gap write-back;
* :mod:`analysis.labels`: scheme labels (name plus ablation switches) and their order;
* :mod:`analysis.pairing`: pairing with the baseline's runs and the gaps (:func:`compare`);
* :mod:`analysis.report`: the markdown and JSON report;
* :mod:`analysis.plots`: the PNG plots.
"""

from .errors import CompareError
from .labels import BASELINE, scheme_label
from .pairing import GapRow, Report, compare
from .plots import plot_curves, plot_gaps
from .report import markdown, report_json
from .runs import Run, collect_paths, read_run_dir
from .wandb_api import collect_wandb_project, writeback
from .wandb_folders import wandb_run_folders

__all__ = [
    "BASELINE",
    "CompareError",
    "GapRow",
    "Report",
    "Run",
    "collect_paths",
    "collect_wandb_project",
    "compare",
    "markdown",
    "plot_curves",
    "plot_gaps",
    "read_run_dir",
    "report_json",
    "scheme_label",
    "wandb_run_folders",
    "writeback",
]
