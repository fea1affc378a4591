"""PNG plots of the loss-gap report (matplotlib, Agg backend): the gap against tokens per parameter,
and the gap along training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CompareError
from .labels import scheme_key
from .pairing import Report
from .runs import budget_text


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(scheme: str, schemes: list[str]) -> Any:
    return _pyplot().get_cmap("tab10")(schemes.index(scheme) % 10)


def _save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns its path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_gaps(report: Report, path: Path) -> Path:
    """Loss gap against tokens per parameter: one panel per model size, one line per scheme."""
    plt, baseline = _pyplot(), report.baseline
    rows = [r for r in report.rows if r.scheme != baseline and r.gap is not None and r.tokens_per_param]
    if not rows:
        raise CompareError(f"nothing to plot: no run has a matching {baseline} baseline")
    models = sorted({r.model for r in rows}, key=lambda m: next((r.params or 0) for r in rows if r.model == m))
    schemes = sorted({r.scheme for r in rows}, key=scheme_key)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        mrows = [r for r in rows if r.model == model]
        for scheme in schemes:
            pts = sorted((r.tokens_per_param, r.gap, r.gap_sd or 0.0) for r in mrows if r.scheme == scheme)
            if not pts:
                continue
            x, y, e = zip(*pts)
            ax.errorbar(x, y, yerr=e if any(e) else None, marker="o", ms=4, capsize=2, label=scheme,
                        color=_color(scheme, schemes))
        params = next((r.params for r in mrows if r.params), None)
        ax.set_title(f"{model}" + (f" ({params / 1e6:.1f}M non-emb. params)" if params else ""), fontsize=10)
        ax.set_xscale("log")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("tokens per parameter")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"final val loss − {baseline}")
    axes[0][-1].legend(fontsize=8)
    return _save_figure(fig, path, dpi=120)


def plot_curves(report: Report, path: Path) -> Path:
    """Gap along training: one panel per (model, budget), one line per scheme."""
    plt, baseline = _pyplot(), report.baseline
    rows = [r for r in report.rows if r.scheme != baseline and r.curve]
    if not rows:
        raise CompareError(f"no validation curves to compare: the runs share no val/loss steps with "
                           f"their {baseline} baseline (set train.eval_every lower)")
    models = sorted({r.model for r in rows}, key=lambda m: next((r.params or 0) for r in rows if r.model == m))
    budgets = sorted({r.budget for r in rows}, key=lambda b: next((r.tokens_per_param or 0) for r in rows
                                                                  if r.budget == b))
    schemes = sorted({r.scheme for r in rows}, key=scheme_key)
    fig, axes = plt.subplots(len(models), len(budgets), figsize=(3.6 * len(budgets), 2.9 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            cell = [r for r in rows if r.model == model and r.budget == budget]
            if not cell:
                ax.set_visible(False)
                continue
            for r in cell:
                steps = sorted(r.curve)
                ax.plot(steps, [r.curve[s] for s in steps], marker=".", label=r.scheme,
                        color=_color(r.scheme, schemes))
            tpp = cell[0].tokens_per_param
            ax.set_title(f"{model}, " + (f"{tpp:.4g} tokens/param" if tpp else budget_text(budget)), fontsize=9)
            ax.axhline(0.0, color="grey", lw=0.8, ls=":")
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel(f"val loss − {baseline}")
            ax.legend(fontsize=7)
    return _save_figure(fig, path, dpi=110)
