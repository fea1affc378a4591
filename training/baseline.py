"""The live loss gap: a quantized run's validation loss minus its bf16 baseline's at the same step.

The baseline is the bf16 run with the same model, data, token budget, batch and seed
(:data:`MATCH_KEYS`), chosen by the trainer's ``baseline`` setting:

* ``auto`` (default): the newest such run under ``run_root`` (each run writes its resolved config
  to ``config.json`` when it starts), else, for an online W&B run, one in its W&B project;
* a run directory, or a W&B run ``ENTITY/PROJECT/RUN_ID``: that run, refused with the differing
  settings named when it is not comparable;
* ``null``: no gap.

At each validation :meth:`LiveGap.at_validation` gives at most one gap to log with that step's row
(W&B takes one value per key and step): the oldest validation step the baseline has a value for
and that has no gap logged yet. A baseline that runs beside this run (a sweep) may not have
reached a step yet; its gap then comes at a later validation, and :meth:`LiveGap.remaining` gives
the rest at the end of the run. Gaps are never interpolated: a step the baseline never validated
has none. Each gap row carries its own axis, ``gap_step``, the step of the two validation losses.

A run that also validates with BF16 linears (``val/loss_bf16``, :mod:`training.validation`) gets
that loss's gap in the same row, ``val/loss_gap_bf16`` and ``val/loss_gap_bf16_rel``, against the
same baseline loss. The baseline is matched on :data:`MATCH_KEYS` alone, so a run with a precision
recipe or a late switch to BF16 (``quant.recipe``, ``quant.schedule``, ...) pairs with the same
bf16 run as its unswitched twin.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .checkpoint import flatten, select
from .identity import BUDGET_KEYS
from .run_dir import CONFIG_FILE, read_metrics, val_losses

BASELINE_SCHEME = "bf16"
MATCH_KEYS = ("model", "data.name", *BUDGET_KEYS, "train.batch_size", "train.seq_len", "seed")
"""What a baseline shares with the run (``train.steps`` only when the budget is in steps)."""
_SKIP = {"checkpoints", "wandb", ".hydra", ".submitit", "__pycache__"}
_WANDB_PATH = re.compile(r"^[\w.-]+/[\w.-]+/[\w]+$")


class BaselineError(ValueError):
    """A named baseline that cannot serve; the message says why and what to do."""


def match_settings(cfg: dict) -> dict[str, Any]:
    """The settings of a resolved config that a baseline must share, as dotted leaf keys."""
    out: dict[str, Any] = {}
    for key in MATCH_KEYS:
        if key == "train.steps" and select(cfg, "train.tokens_per_param") is not None:
            continue  # the budget is tokens per parameter; steps follow from it
        out |= flatten(select(cfg, key), key)
    return out


def differences(ours: dict, theirs: dict) -> dict[str, tuple[Any, Any]]:
    """``{key: (ours, theirs)}`` for every :func:`match_settings` key that differs."""
    a, b = match_settings(ours), match_settings(theirs)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


class Baseline:
    """A bf16 run's validation losses by step, read afresh at each call (it may still be running)."""

    def __init__(self, where: str, read: Callable[[], dict[int, float]]) -> None:
        self.where, self._read = where, read

    def losses(self) -> dict[int, float]:
        try:
            return self._read()
        except (OSError, ValueError):  # a file being rewritten, a W&B hiccup: try at the next validation
            return {}


def local_baseline(run_dir: Path) -> Baseline:
    return Baseline(str(run_dir), lambda: val_losses(read_metrics(run_dir)))


def wandb_baseline(run: Any, path: str) -> Baseline:
    """A baseline read through the W&B API (``wandb.apis.public.Run``)."""
    return Baseline(f"W&B run {path}", lambda: val_losses(run.scan_history(keys=["_step", "val/loss"]), "_step"))


def run_dirs_under(root: Path) -> Iterator[Path]:
    """Directories under ``root`` that hold a run's ``config.json`` (moved-aside runs excluded)."""
    if not root.is_dir():
        return
    stack = [root]
    while stack:
        d = stack.pop()
        if (d / CONFIG_FILE).is_file():
            yield d
            continue
        try:
            stack += [p for p in d.iterdir() if p.is_dir() and p.name not in _SKIP and ".replaced-" not in p.name]
        except OSError:
            continue


def _read_config(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None


def find_local(cfg: dict, root: Path, this_run: Path) -> Path | None:
    """The newest bf16 run under ``root`` comparable with ``cfg`` (by its config's time)."""
    found = []
    for d in run_dirs_under(root):
        theirs = _read_config(d)
        if (d.resolve() != this_run.resolve() and theirs is not None
                and select(theirs, "quant.name") == BASELINE_SCHEME and not differences(cfg, theirs)):
            found.append(((d / CONFIG_FILE).stat().st_mtime, d))
    return max(found)[1] if found else None


def find_wandb(cfg: dict, project: str, api: Any) -> tuple[Any, str] | None:
    """A comparable bf16 run of the W&B ``project`` (``ENTITY/PROJECT``), newest first."""
    runs = api.runs(project, filters={"config.quant.name": BASELINE_SCHEME, "config.seed": cfg.get("seed")},
                    order="-created_at")
    for run in runs:
        if not differences(cfg, dict(run.config)):
            return run, f"{project}/{run.id}"
    return None


def _named(setting: str, cfg: dict, api_factory: Callable[[], Any]) -> Baseline:
    path = Path(setting)
    if path.is_dir():
        theirs = _read_config(path)
        if theirs is None:
            raise BaselineError(f"baseline={setting}: no {CONFIG_FILE} in that directory (is it a run directory "
                                f"of this trainer?). Fix: baseline=auto, or the directory of a bf16 run.")
        where, make = str(path), lambda: local_baseline(path)
    elif _WANDB_PATH.match(setting):
        try:
            run = api_factory().run(setting)
        except Exception as err:
            raise BaselineError(f"baseline={setting}: the W&B run cannot be read ({err}). Fix: check the path "
                                f"ENTITY/PROJECT/RUN_ID and `wandb login`, or baseline=auto.") from err
        theirs, where, make = dict(run.config), f"W&B run {setting}", lambda: wandb_baseline(run, setting)
    else:
        raise BaselineError(f"baseline={setting} is neither a run directory nor a W&B run ENTITY/PROJECT/RUN_ID. "
                            f"Fix: baseline=auto (a matching bf16 run under run_root), a path, or null.")
    if select(theirs, "quant.name") != BASELINE_SCHEME:
        raise BaselineError(f"baseline={setting} is a {select(theirs, 'quant.name')} run, not bf16. Fix: name "
                            f"a bf16 run, or baseline=auto.")
    diff = differences(cfg, theirs)
    if diff:
        said = "; ".join(f"{k}: {ours!r} here, {other!r} there" for k, (ours, other) in diff.items())
        raise BaselineError(f"baseline={where} is not comparable with this run ({said}): a baseline shares the "
                            f"model, token budget, batch and seed. Fix: name a matching bf16 run, or baseline=auto.")
    return make()


def _default_api() -> Any:
    import wandb

    return wandb.Api(timeout=30)


class LiveGap:
    """The gap bookkeeping of one run (see the module docstring). ``wandb_project`` is the
    run's ``ENTITY/PROJECT`` when it is online (``auto`` then also looks there)."""

    def __init__(self, cfg: dict, run_dir: Path, wandb_project: str | None = None,
                 api_factory: Callable[[], Any] = _default_api) -> None:
        self.cfg, self.run_dir, self.project, self.api_factory = cfg, run_dir, wandb_project, api_factory
        self.setting = cfg.get("baseline", "auto")
        self.baseline: Baseline | None = None
        self.own: dict[int, float] = {}  # this run's validation losses by step
        self.own_bf16: dict[int, float] = {}  # ... and those with BF16 linears
        self.gaps: dict[int, float] = {}  # the gaps logged so far, by step
        self.gaps_bf16: dict[int, float] = {}  # ... and those of the BF16-validated losses
        self.active = select(cfg, "quant.name") != BASELINE_SCHEME and self.setting is not None
        self.line = self._choose()

    def _choose(self) -> str:
        """Find the baseline; the line that says which, or why there is none."""
        if select(self.cfg, "quant.name") == BASELINE_SCHEME:
            return "loss gap: none (this run is the bf16 baseline)"
        if self.setting is None:
            return "loss gap: off (baseline=null)"
        if self.setting != "auto":
            self.baseline = _named(str(self.setting), self.cfg, self.api_factory)
            return f"loss gap against the bf16 run {self.baseline.where} (baseline={self.setting})"
        if self._look():
            return (f"loss gap against the bf16 run {self.baseline.where} (baseline=auto: same model, data, budget, "
                    f"batch, seed)")
        where = f"under {self.cfg.get('run_root')}" + (f" or in W&B project {self.project}" if self.project else "")
        return (f"loss gap: none yet, no bf16 run with the same model, data, budget, batch and seed {where} "
                f"(looked for again at each validation). For one, run quant=bf16 with the same settings, or name "
                f"it with baseline=<run dir or ENTITY/PROJECT/RUN_ID>; baseline=null turns this off")

    def _look(self) -> bool:
        found = find_local(self.cfg, Path(str(self.cfg.get("run_root", "runs"))), self.run_dir)
        if found is not None:
            self.baseline = local_baseline(found)
            return True
        if self.project:
            try:
                hit = find_wandb(self.cfg, self.project, self.api_factory())
            except Exception:
                hit = None
            if hit is not None:
                self.baseline = wandb_baseline(*hit)
                return True
        return False

    def resume(self, rows: list[dict]) -> None:
        """Take up the validations and gaps already in ``metrics.jsonl`` (a resumed run)."""
        self.own.update(val_losses(rows))
        self.own_bf16.update(val_losses(rows, key="val/loss_bf16"))
        self.gaps.update({int(r["gap_step"]): r["val/loss_gap"] for r in rows if r.get("gap_step") is not None})
        self.gaps_bf16.update({int(r["gap_step"]): r["val/loss_gap_bf16"] for r in rows
                               if r.get("gap_step") is not None and "val/loss_gap_bf16" in r})

    def at_validation(self, step: int, val_loss: float,
                      val_loss_bf16: float | None = None) -> tuple[dict[str, float], str | None]:
        """The gap row to log with this validation (empty when none is ready), and a line to
        print when the baseline was found just now."""
        self.own[step] = val_loss
        if val_loss_bf16 is not None:
            self.own_bf16[step] = val_loss_bf16
        if not self.active:
            return {}, None
        found = None
        if self.baseline is None:
            if not self._look():
                return {}, None
            found = f"loss gap: found the bf16 baseline {self.baseline.where}"
        rows = self._ready(self.baseline.losses())
        return (rows[0] if rows else {}), found

    def remaining(self) -> list[dict[str, float]]:
        """Every gap not logged yet whose baseline value exists (the end of the run)."""
        if not self.active or (self.baseline is None and not self._look()):
            return []
        return self._ready(self.baseline.losses(), every=True)

    def _ready(self, base: dict[int, float], every: bool = False) -> list[dict[str, float]]:
        steps = [s for s in sorted(self.own) if s not in self.gaps and s in base]
        rows = []
        for s in steps if every else steps[:1]:
            gap = self.gaps[s] = self.own[s] - base[s]
            row = {"gap_step": s, "val/loss_gap": gap, "val/loss_gap_rel": gap / base[s]}
            if s in self.own_bf16:
                gap_bf16 = self.gaps_bf16[s] = self.own_bf16[s] - base[s]
                row |= {"val/loss_gap_bf16": gap_bf16, "val/loss_gap_bf16_rel": gap_bf16 / base[s]}
            rows.append(row)
        return rows

    def missing(self) -> list[int]:
        """This run's validation steps without a gap although a baseline exists (it has no value
        there yet); none when there is no baseline at all."""
        if not self.active or self.baseline is None:
            return []
        return [s for s in sorted(self.own) if s not in self.gaps]

    def final(self, step: int) -> float | None:
        """The gap logged for the final validation ``step`` (None when the baseline had no value
        there; call after :meth:`remaining`)."""
        return self.gaps.get(step)

    def final_bf16(self, step: int) -> float | None:
        """:meth:`final` of the BF16-validated loss (None also when the run has none)."""
        return self.gaps_bf16.get(step)
