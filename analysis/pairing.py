"""Pairing of every scheme's runs with the baseline's of the same model and token budget, and the
loss gaps that follow.

A run is compared with the baseline runs (default ``bf16``) of the same model and the same token
budget (:attr:`analysis.runs.Run.budget`); runs of different budgets never pair. With seeds on both
sides, the gap is the mean over the seeds both have of (scheme − baseline); without common seeds
it is mean(scheme) − mean(baseline), marked unpaired. Scheme runs without a baseline, and runs
without a final validation loss, are kept apart.

Runs that also validated with BF16 linears (``final_val_loss_bf16``, :mod:`training.validation`)
get that loss's gap to the same baseline losses as well (``gap_bf16``), when every run of the row
has one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from .errors import CompareError
from .labels import BASELINE, scheme_key
from .runs import Budget, Run, budget_text


@dataclass
class GapRow:
    """One scheme of one model and budget: its mean final loss and its gap to the baseline."""

    model: str
    params: int | None
    tokens: int | None
    tokens_per_param: float | None
    budget: Budget
    scheme: str
    final_loss: float  # mean over the scheme's runs
    n: int  # seeds averaged
    baseline_loss: float | None = None
    gap: float | None = None
    gap_sd: float | None = None
    gap_bf16: float | None = None  # the gap of the BF16-validated loss, same pairing
    paired: bool = True
    runs: list[Run] = field(default_factory=list)
    baselines: list[list[Run]] = field(default_factory=list)  # per run: the baseline run(s) it is taken against
    curve: dict[int, float] = field(default_factory=dict)  # step -> mean gap


@dataclass
class Report:
    """The outcome of :func:`compare`."""

    rows: list[GapRow]  # paired (and the baselines themselves, gap None)
    unmatched: list[GapRow]  # no baseline run of that model and budget
    incomplete: list[Run]
    notes: list[str]
    baseline: str  # the scheme every gap is taken against


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: list[float]) -> float | None:
    """Sample standard deviation; None for fewer than two values."""
    if len(xs) < 2:
        return None
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def dedup(runs: list[Run], notes: list[str]) -> list[Run]:
    """One run per (model, scheme, budget, seed) when the seed is known, and per W&B id.

    Finished runs win over unfinished ones, then local files over the API;
    each duplicate left out gets a note.
    """
    order = {"local": 0, "wandb-offline": 1, "wandb": 2}
    kept: dict[tuple, Run] = {}
    out = []
    for run in sorted(runs, key=lambda r: (r.final_val_loss is None, order.get(r.source, 3))):
        keys = []
        if run.seed is not None:
            keys.append(("cfg", run.model, run.scheme, run.budget, run.seed))
        if run.run_id:
            keys.append(("id", run.run_id))
        dup = next((kept[k] for k in keys if k in kept), None)
        if dup is not None:
            notes.append(f"duplicate of {dup.name} ({dup.path}) ignored: {run.path}")
            continue
        for k in keys:
            kept[k] = run
        out.append(run)
    return out


def compare(runs: list[Run], baseline: str = BASELINE, notes: list[str] | None = None) -> Report:
    """Pair every scheme's runs with the baseline's of the same model and budget."""
    notes = list(notes or [])
    if not runs:
        raise CompareError("no runs found. Fix: pass trainer run directories (with summary.json / "
                           "metrics.jsonl), offline W&B folders, or --wandb ENTITY/PROJECT.")
    runs = dedup(runs, notes)
    incomplete, complete = [], []
    for run in runs:
        if run.final_val_loss is None:
            incomplete.append(run)
        elif run.model is None or run.scheme is None or run.budget is None:
            notes.append(f"{run.path}: model, scheme or token budget unknown; not compared")
        else:
            complete.append(run)
    groups: dict[tuple, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in complete:
        groups[(run.model, run.budget)][run.scheme].append(run)

    rows, unmatched = [], []
    for (model, budget), by_scheme in groups.items():
        base_runs = by_scheme.get(baseline, [])
        base_by_seed = {r.seed: r for r in base_runs if r.seed is not None}
        for scheme in sorted(by_scheme, key=scheme_key):
            rs = by_scheme[scheme]
            ref = rs[0]
            tokens = next((r.tokens for r in rs if r.tokens), None)
            params = next((r.params for r in rs if r.params), None)
            row = GapRow(model=model, params=params, tokens=tokens,
                         tokens_per_param=(tokens / params) if tokens and params else ref.tokens_per_param,
                         budget=budget, scheme=scheme, final_loss=_mean([r.final_val_loss for r in rs]),
                         n=len(rs), runs=rs)
            if scheme == baseline:
                row.baseline_loss = row.final_loss
                rows.append(row)
                continue
            if not base_runs:
                unmatched.append(row)
                continue
            pairs = [(r, base_by_seed[r.seed]) for r in rs if r.seed is not None and r.seed in base_by_seed]
            if pairs:
                gaps = [r.final_val_loss - b.final_val_loss for r, b in pairs]
                row.gap, row.gap_sd, row.n = _mean(gaps), _sd(gaps), len(pairs)
                row.gap_bf16 = _bf16_gap([r for r, _ in pairs], [b.final_val_loss for _, b in pairs])
                row.final_loss = _mean([r.final_val_loss for r, _ in pairs])
                row.baseline_loss = _mean([b.final_val_loss for _, b in pairs])
                row.runs = [r for r, _ in pairs]
                row.baselines = [[b] for _, b in pairs]
                if len(pairs) < len(rs):
                    notes.append(f"{model} {scheme} {budget_text(budget)}: {len(rs) - len(pairs)} run(s) "
                                 f"without a {baseline} run of the same seed left out of the gap")
            else:
                row.baseline_loss = _mean([b.final_val_loss for b in base_runs])
                row.gap = row.final_loss - row.baseline_loss
                row.gap_bf16 = _bf16_gap(rs, [row.baseline_loss] * len(rs))
                row.gap_sd = _sd([r.final_val_loss for r in rs])
                row.paired = False
                row.baselines = [base_runs for _ in rs]
            row.curve = _gap_curve(row.runs, row.baselines)
            rows.append(row)

    def key(r: GapRow) -> tuple:
        return (r.params or 0, r.model, r.tokens_per_param or 0, str(r.budget), scheme_key(r.scheme))

    return Report(sorted(rows, key=key), sorted(unmatched, key=key), incomplete, notes, baseline)


def _bf16_gap(runs: list[Run], baselines: list[float]) -> float | None:
    """Mean over ``runs`` of final_val_loss_bf16 − its baseline loss; None unless every run has one."""
    if not runs or any(r.final_val_loss_bf16 is None for r in runs):
        return None
    return _mean([r.final_val_loss_bf16 - b for r, b in zip(runs, baselines)])


def run_gap_curve(run: Run, bases: list[Run]) -> dict[int, tuple[float, float]]:
    """``{step: (gap, baseline loss)}`` of one run against its baseline run(s) (their mean), at
    the steps both evaluated; never interpolated."""
    out = {}
    for step, v in sorted(run.val_curve.items()):
        ref = [b.val_curve[step] for b in bases if step in b.val_curve]
        if ref:
            out[step] = (v - _mean(ref), _mean(ref))
    return out


def _gap_curve(runs: list[Run], baselines: list[list[Run]]) -> dict[int, float]:
    """Mean over runs of val/loss(scheme) − val/loss(baseline) at the steps both evaluated."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for run, bases in zip(runs, baselines):
        for step, (gap, _) in run_gap_curve(run, bases).items():
            per_step[step].append(gap)
    return {s: _mean(v) for s, v in sorted(per_step.items())}
