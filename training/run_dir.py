"""The run directory's life cycle: a fresh start moves an earlier run aside instead of mixing with
it, a resumed run's metrics file is rewound to the checkpoint it resumes from, and the record of
the command (``config.json``, ``.hydra/``) is written only once the run really trains: a refused
command, or a finished run started again, leaves an existing run as it was."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

CONFIG_FILE = "config.json"
"""The resolved config a run writes into its directory when it starts training."""

RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "train.log", "wandb")
"""What a run writes into its directory; any of them means an earlier run lives there."""

HYDRA_DIR = ".hydra"


def holds_a_run(run_dir: Path) -> bool:
    """True when ``run_dir`` holds outputs of an earlier run."""
    return any((Path(run_dir) / name).exists() for name in RUN_FILES)


def move_aside(run_dir: Path, keep: tuple[str, ...] = ()) -> Path:
    """Rename ``run_dir`` to ``<run_dir>.replaced-<YYYYmmdd-HHMMSS>`` and recreate it with only
    the entries named in ``keep`` moved back (a pending stop request). Returns the earlier run's
    new name."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
        n += 1
    os.replace(run_dir, aside)
    run_dir.mkdir(parents=True)
    for name in keep:
        if (aside / name).exists():
            os.replace(aside / name, run_dir / name)
    return aside


def record_command(run_dir: Path, cfg: DictConfig, resolved: dict[str, Any]) -> None:
    """Write the run's resolved config to ``config.json`` (what a quantized run looks for in its
    bf16 baseline, training/baseline.py), unless it holds that already, and Hydra's record of the
    command to ``.hydra/`` (``config.yaml``, ``hydra.yaml``, ``overrides.yaml``, as Hydra lays it
    out) when the run was started through Hydra."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(resolved, default=str)
    path = run_dir / CONFIG_FILE
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not started through Hydra: training.trainer.run(cfg) called from code
        return
    out = run_dir / HYDRA_DIR
    out.mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), out / "overrides.yaml")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (none when it has none); a line cut by a kill, or
    being written, is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def val_losses(rows: Iterable[dict], step_key: str = "step", key: str = "val/loss") -> dict[int, float]:
    """``key`` (``val/loss``, or ``val/loss_bf16``) by step from metric rows (``step_key``:
    ``step``, or W&B's ``_step``); a step logged again (a resumed run) keeps its last value; a
    value that is not a finite number is left out."""
    out = {}
    for row in rows:
        step = row.get(step_key)
        try:
            value = float(row.get(key))
        except (TypeError, ValueError):
            continue
        if step is not None and math.isfinite(value):
            out[int(step)] = value
    return out


def rewind_metrics(run_dir: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (the checkpoint a run resumes from) and
    append the later ones, which the resumed run replaces, to ``metrics.replaced.jsonl``.
    Returns how many rows moved. The rewrite is atomic (a kill leaves either file whole)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, later = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:
            row_step = step + 1  # a torn last line of a killed run: replaced, but kept aside
        (keep if row_step <= step else later).append(line)
    if not later:
        return 0
    with open(path.with_name("metrics.replaced.jsonl"), "a") as f:
        f.write("".join(line + "\n" for line in later))
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(later)
