"""The loss-gap report of :func:`analysis.pairing.compare` as markdown and as JSON."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .labels import scheme_key
from .pairing import GapRow, Report
from .runs import budget_text


def _fmt(x: float | None, spec: str = ".4f", signed: bool = False) -> str:
    if x is None:
        return "—"
    return format(x, ("+" if signed else "") + spec)


def _tokens_text(row: GapRow) -> str:
    return f"{row.tokens:,}" if row.tokens else budget_text(row.budget)


def markdown(report: Report) -> str:
    """The report: the gap table (with the gap of the BF16-validated loss when runs have one), a
    per-model pivot of the gaps (SPEC §5's layout), runs without a baseline, runs without a final
    validation loss, and notes."""
    baseline = report.baseline
    out = [f"## Final validation loss and loss gap to {baseline}", ""]
    if report.rows:
        bf16_val = any(r.gap_bf16 is not None for r in report.rows)
        extra = (" gap, BF16 val |", "---:|") if bf16_val else ("", "")
        out += ["| model | non-emb. params | tokens | tokens/param | scheme | final val loss | "
                f"{baseline} | gap |{extra[0]} n |", f"|---|---:|---:|---:|---|---:|---:|---:|{extra[1]}---:|"]
        for r in report.rows:
            gap = "baseline" if r.scheme == baseline else _fmt(r.gap, signed=True)
            if r.gap is not None and r.gap_sd is not None:
                gap += f" ± {r.gap_sd:.4f}"
            if r.gap is not None and not r.paired:
                gap += " (unpaired)"
            if bf16_val:
                gap += " | " + ("baseline" if r.scheme == baseline else _fmt(r.gap_bf16, signed=True))
            params = f"{r.params:,}" if r.params else "—"
            out.append(f"| {r.model} | {params} | {_tokens_text(r)} | {_fmt(r.tokens_per_param, '.4g')} | "
                       f"{r.scheme} | {r.final_loss:.4f} | {_fmt(r.baseline_loss)} | {gap} | {r.n} |")
        out += ["", f"n: seeds averaged (paired with the {baseline} run of the same seed); ± is their "
                f"standard deviation. Gap > 0: the scheme's validation loss is above {baseline}'s."
                + (" Gap, BF16 val: the final validation loss of the same weights with every linear in "
                   f"BF16 (val/loss_bf16), minus the same {baseline} loss." if bf16_val else ""), ""]
        pivot = _pivot(report.rows, baseline)
        if pivot:
            out += pivot
    else:
        out += [f"(no run has a matching {baseline} baseline)", ""]
    if report.unmatched:
        out += [f"## Runs without a matching {baseline} baseline", "",
                "| model | tokens | tokens/param | scheme | final val loss | n | runs |",
                "|---|---:|---:|---|---:|---:|---|"]
        for r in report.unmatched:
            out.append(f"| {r.model} | {_tokens_text(r)} | {_fmt(r.tokens_per_param, '.4g')} | {r.scheme} | "
                       f"{r.final_loss:.4f} | {r.n} | {', '.join(x.name for x in r.runs)} |")
        out += ["", f"No {baseline} run of the same model and token budget was found; runs of other "
                "budgets are never paired.", ""]
    if report.incomplete:
        out += ["## Runs without a final validation loss (unfinished or failed)", "",
                "| run | last logged step | last val loss | where |", "|---|---:|---:|---|"]
        for run in report.incomplete:
            last_val = run.val_curve[max(run.val_curve)] if run.val_curve else None
            out.append(f"| {run.name} | {run.last_step if run.last_step is not None else '—'} | "
                       f"{_fmt(last_val)} | {run.path} |")
        out.append("")
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    return "\n".join(out)


def _pivot(rows: list[GapRow], baseline: str) -> list[str]:
    """Per model: tokens/param down, schemes across, gaps in the cells (the SPEC §5 layout)."""
    out = []
    by_model: dict[str, list[GapRow]] = defaultdict(list)
    for r in rows:
        if r.scheme != baseline and r.gap is not None:
            by_model[r.model].append(r)
    for model, rs in by_model.items():
        schemes = sorted({r.scheme for r in rs}, key=scheme_key)
        budgets = sorted({r.budget for r in rs}, key=lambda b: next(
            (r.tokens_per_param or 0) for r in rs if r.budget == b))
        out += [f"### Loss gap to {baseline}, {model}", "",
                "| tokens/param | " + " | ".join(schemes) + " |", "|---:|" + "---:|" * len(schemes)]
        for b in budgets:
            cells = {r.scheme: r for r in rs if r.budget == b}
            tpp = next(r.tokens_per_param for r in rs if r.budget == b)
            label = _fmt(tpp, ".4g") if tpp is not None else budget_text(b)
            out.append(f"| {label} | " + " | ".join(_fmt(cells[s].gap, signed=True) if s in cells else "—"
                                                    for s in schemes) + " |")
        out.append("")
    return out


def report_json(report: Report) -> dict[str, Any]:
    """The report's numbers: ``baseline`` (the scheme every gap is against), ``rows``,
    ``no_baseline``, ``incomplete`` and ``notes``."""
    def row(r: GapRow) -> dict[str, Any]:
        return {"model": r.model, "non_embedding_params": r.params, "tokens": r.tokens,
                "tokens_per_param": r.tokens_per_param, "scheme": r.scheme, "final_val_loss": r.final_loss,
                "baseline_val_loss": r.baseline_loss, "loss_gap": r.gap, "loss_gap_sd": r.gap_sd,
                "loss_gap_bf16": r.gap_bf16, "n": r.n,
                "paired": r.paired, "runs": [x.name for x in r.runs],
                "gap_curve": {str(k): v for k, v in r.curve.items()}}

    return {"baseline": report.baseline, "rows": [row(r) for r in report.rows],
            "no_baseline": [row(r) for r in report.unmatched],
            "incomplete": [{"name": r.name, "path": r.path, "last_step": r.last_step} for r in report.incomplete],
            "notes": report.notes}
