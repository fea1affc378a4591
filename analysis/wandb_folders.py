"""W&B run folders found on disk (``wandb/offline-run-*/``, ``wandb/run-*/``), recognised by name.

Their contents are not read: W&B's ``.wandb`` transaction log is a private format with no stable
API. A trainer run directory holds the same numbers in its own files (``metrics.jsonl``,
``summary.json``, ``config.json``); a W&B folder without its run directory is reported with the
fix, ``wandb sync <folder>`` and then ``--wandb ENTITY/PROJECT`` (:func:`orphan_note`).
"""

from __future__ import annotations

import re
from pathlib import Path

_FOLDER = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-(?P<id>[a-z0-9]+)(?:-\d+)?$")


def is_wandb_run_folder(path: Path) -> bool:
    """True for a W&B run folder: ``[offline-]run-YYYYMMDD_HHMMSS-<id>``."""
    return path.is_dir() and _FOLDER.match(path.name) is not None


def wandb_run_id(folder: Path) -> str | None:
    """The W&B run id in a run folder's name."""
    m = _FOLDER.match(folder.name)
    return m["id"] if m else None


def wandb_run_folders(root: Path) -> list[Path]:
    """The W&B run folders under ``root/wandb``, oldest first."""
    base = root / "wandb"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if is_wandb_run_folder(p))


def orphan_note(folder: Path) -> str:
    """What to do about a W&B run folder that is not inside a trainer run directory."""
    return (f"{folder}: a W&B run without its trainer run directory is not read (W&B's .wandb log is a "
            f"private format). Fix: `wandb sync {folder}`, then read it through the API with "
            f"--wandb ENTITY/PROJECT; or pass the run directory it came from")
