"""Training runs as :class:`Run` records, read from trainer run directories and offline W&B runs.

Sources (any mix; :func:`collect_paths` walks them):

* a trainer run directory (``metrics.jsonl`` and/or ``summary.json``); its config is read from
  ``config.json`` (the resolved config the trainer writes), ``.hydra/config.yaml`` (Hydra's
  copy) or ``config.yaml``; model, scheme and seed can also come from its name
  (``<model>-<scheme>-<budget>-s<seed>``, train.yaml's ``run_name``), its W&B run id from the
  name of the W&B folder inside it. Directories are searched recursively (``checkpoints/``,
  ``.submitit/`` and the like are skipped);
* a W&B run folder outside any run directory is not read, only reported with the fix
  (:mod:`analysis.wandb_folders`).

Runs read through the W&B API are built in :mod:`analysis.wandb_api` with the same helpers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.identity import parse_run_name
from training.run_dir import read_metrics, val_losses

from .errors import CompareError
from .labels import scheme_label
from .wandb_folders import is_wandb_run_folder, orphan_note, wandb_run_folders, wandb_run_id

SKIP_DIRS = {"checkpoints", ".submitit", "wandb", ".hydra", "__pycache__", ".git"}

Budget = tuple[str, int | float]
"""What two runs must share to be compared: ``("tokens", n)``, ``("tpp", x)`` or ``("steps", n)``."""


@dataclass
class Run:
    """One training run, whatever its source."""

    name: str
    source: str  # "local", "wandb-offline", "wandb"
    path: str
    model: str | None = None
    scheme: str | None = None
    seed: int | None = None
    tokens: int | None = None
    params: int | None = None  # non-embedding parameters
    tokens_per_param_cfg: float | None = None
    steps: int | None = None
    final_val_loss: float | None = None
    final_val_loss_bf16: float | None = None  # the same weights with BF16 linears (val/loss_bf16)
    last_step: int | None = None
    val_curve: dict[int, float] = field(default_factory=dict)  # step -> val/loss
    run_id: str | None = None
    handle: Any = None  # the wandb.apis.public.Run, for --writeback

    @property
    def tokens_per_param(self) -> float | None:
        """Tokens per non-embedding parameter: from the counts when known, else the config's."""
        if self.tokens and self.params:
            return self.tokens / self.params
        return self.tokens_per_param_cfg

    @property
    def budget(self) -> Budget | None:
        """What two runs must share to be compared (besides the model)."""
        if self.tokens:
            return ("tokens", int(self.tokens))
        if self.tokens_per_param_cfg is not None and self.params:
            return ("tokens", int(round(self.tokens_per_param_cfg * self.params)))
        if self.tokens_per_param_cfg is not None:
            return ("tpp", float(self.tokens_per_param_cfg))
        if self.steps:
            return ("steps", int(self.steps))
        return None


def budget_text(budget: Budget) -> str:
    """A budget as the report writes it: ``762,064,000 tokens``, ``25 tokens/param``, ``300 steps``."""
    kind, value = budget
    return {"tokens": f"{value:,} tokens", "tpp": f"{value:g} tokens/param", "steps": f"{value} steps"}[kind]


# ----------------------------------------------------------------------------- what a run says


def _get(cfg: dict | None, dotted: str, default: Any = None) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _non_embedding_params(model_cfg: dict | None) -> int | None:
    """Count of a model config's non-embedding parameters (built on the meta device)."""
    if not isinstance(model_cfg, dict):
        return None
    try:
        from model import build_model

        return build_model(model_cfg, device="meta").num_params(non_embedding=True)
    except Exception:
        return None


def apply_config(run: Run, cfg: dict | None) -> None:
    """Fill what is still unknown about ``run`` from a resolved trainer config."""
    if not isinstance(cfg, dict):
        return
    run.model = run.model or _get(cfg, "model.name")
    if run.scheme is None and _get(cfg, "quant.name") is not None:
        run.scheme = scheme_label(_get(cfg, "quant.name"), _get(cfg, "quant"))
    elif run.scheme is not None and isinstance(_get(cfg, "quant"), dict):
        run.scheme = scheme_label(run.scheme, _get(cfg, "quant"))
    if run.seed is None and isinstance(cfg.get("seed"), int):
        run.seed = cfg["seed"]
    if run.tokens_per_param_cfg is None:
        run.tokens_per_param_cfg = number(_get(cfg, "train.tokens_per_param"))
    if run.steps is None and run.tokens is None and run.tokens_per_param_cfg is None:
        steps = _get(cfg, "train.steps")
        run.steps = int(steps) if isinstance(steps, int) else None
    if run.params is None and run.tokens_per_param_cfg is not None:
        run.params = _non_embedding_params(_get(cfg, "model"))
    if run.name in ("", None) and cfg.get("run_name"):
        run.name = cfg["run_name"]


def apply_summary(run: Run, summary: dict) -> None:
    """Take the final loss, token and parameter counts, model and scheme from a run's summary."""
    run.final_val_loss = number(summary.get("final_val_loss"))
    run.final_val_loss_bf16 = number(summary.get("final_val_loss_bf16"))
    if summary.get("tokens") is not None:
        run.tokens = int(summary["tokens"])
    if summary.get("non_embedding_params") is not None:
        run.params = int(summary["non_embedding_params"])
    if summary.get("steps") is not None:
        run.steps = int(summary["steps"])
    run.model = summary.get("model") or run.model
    # summary.scheme is the bare name; the config's quant group may add ablation labels later.
    run.scheme = summary.get("scheme") or run.scheme


def apply_name(run: Run, name: str) -> None:
    """What a run name says (:func:`training.identity.parse_run_name`: model, the scheme's report
    label, seed and budget), for what is still unknown."""
    parts = parse_run_name(name)
    if parts is None:
        return
    run.model = run.model or parts.model
    run.scheme = run.scheme or parts.scheme
    if run.seed is None:
        run.seed = parts.seed
    if run.tokens is None and run.tokens_per_param_cfg is None and run.steps is None:
        run.tokens_per_param_cfg, run.steps = parts.tokens_per_param, parts.steps


# ----------------------------------------------------------------------------- readers


def _read_local_config(run_dir: Path) -> dict | None:
    if (run_dir / "config.json").is_file():
        try:
            return json.loads((run_dir / "config.json").read_text())
        except ValueError:
            pass
    for candidate in (run_dir / ".hydra" / "config.yaml", run_dir / "config.yaml"):
        if candidate.is_file():
            from omegaconf import OmegaConf

            try:
                return OmegaConf.to_container(OmegaConf.load(candidate), resolve=False)
            except Exception:
                continue
    return None


def is_run_dir(path: Path) -> bool:
    """True for a trainer run directory (it has ``summary.json`` or ``metrics.jsonl``)."""
    return (path / "summary.json").is_file() or (path / "metrics.jsonl").is_file()


def read_run_dir(run_dir: Path) -> Run:
    """A trainer run directory: summary.json, metrics.jsonl, and the config it can find."""
    run = Run(name=run_dir.name, source="local", path=str(run_dir))
    if (run_dir / "summary.json").is_file():
        apply_summary(run, json.loads((run_dir / "summary.json").read_text()))
    rows = read_metrics(run_dir)
    run.val_curve = val_losses(rows)
    steps = [int(r["step"]) for r in rows if r.get("step") is not None]
    run.last_step = max(steps) if steps else None
    cfg = _read_local_config(run_dir)
    wb_folders = wandb_run_folders(run_dir)
    if wb_folders:  # the trainer writes one W&B run per run dir (a resumed run: more folders, one id)
        run.run_id = wandb_run_id(wb_folders[-1])
    apply_config(run, cfg)
    apply_name(run, run.name)
    if cfg and cfg.get("run_name") and parse_run_name(str(cfg["run_name"])):
        run.name = cfg["run_name"]
    return run


def collect_paths(paths: Iterable[Path]) -> tuple[list[Run], list[str]]:
    """Every run under ``paths`` (run dirs, searched recursively); notes on what was skipped, a
    W&B run folder outside a run directory among them (:func:`analysis.wandb_folders.orphan_note`)."""
    runs: list[Run] = []
    notes: list[str] = []
    for root in paths:
        root = Path(root)
        if not root.exists():
            raise CompareError(f"{root} does not exist")
        if root.is_file():
            if root.suffix == ".wandb":
                raise CompareError(orphan_note(root.parent))
            raise CompareError(f"{root}: expected a run directory or a directory of runs")
        if is_wandb_run_folder(root):
            notes.append(orphan_note(root))
            continue
        stack = [root]
        while stack:
            d = stack.pop()
            if is_run_dir(d):
                try:
                    runs.append(read_run_dir(d))
                except Exception as err:  # one broken run must not hide the others
                    notes.append(f"skipped {d}: {err}")
                continue
            notes += [orphan_note(folder) for folder in wandb_run_folders(d)]
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir() and p.name not in SKIP_DIRS)
            except PermissionError:
                continue
            stack.extend(reversed(children))
    return runs, notes
