"""Runs of a W&B project read through ``wandb.Api()`` (needs an API key and network), and the
write-back of their loss gaps (curves and summaries) into those runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from training.run_dir import val_losses

from .errors import CompareError
from .pairing import GapRow, run_gap_curve
from .runs import Run, apply_config, apply_name, apply_summary, number


def collect_wandb_project(project: str, api: Any = None) -> list[Run]:
    """Every run of a W&B project (``ENTITY/PROJECT``); ``api`` defaults to ``wandb.Api()``."""
    if api is None:
        import wandb

        try:
            api = wandb.Api(timeout=60)
        except Exception as err:
            raise CompareError(
                f"cannot reach W&B for --wandb {project}: {str(err).rstrip('.')}. Fix: `wandb login` (or set "
                f"WANDB_API_KEY) on a machine with network, or pass the run directories instead."
            ) from err
    try:
        return [_api_run(r, project) for r in api.runs(project)]
    except CompareError:
        raise
    except Exception as err:
        raise CompareError(f"reading the W&B project {project} failed: {str(err).rstrip('.')}. Fix: check "
                           f"ENTITY/PROJECT, the API key and the network, or pass the run directories "
                           f"instead.") from err


def _api_run(r: Any, project: str) -> Run:
    """One run of the W&B API (``wandb.apis.public.Run``)."""
    config = {k: v for k, v in dict(r.config).items() if not k.startswith("_")}
    summary = dict(getattr(r, "summary_metrics", None) or r.summary)
    run = Run(name=r.name, source="wandb", path=f"{project}/{r.id}", run_id=r.id, handle=r)
    apply_summary(run, summary)
    apply_config(run, config)
    apply_name(run, run.name)
    try:
        rows = r.scan_history(keys=["_step", "val/loss"])
        run.val_curve = val_losses(rows, "_step")
    except Exception:
        run.val_curve = {}
    run.last_step = number(summary.get("_step"))
    return run


def _resume_run(run: Run) -> Any:
    """The W&B run of ``run`` resumed for writing (``wandb.init(resume="must")``)."""
    import wandb

    entity, project, _ = run.path.split("/")
    return wandb.init(id=run.run_id, entity=entity, project=project, resume="must",
                      settings=wandb.Settings(quiet=True, silent=True))


def writeback(rows: list[GapRow], log: Callable[[str], Any] = print,
              resume: Callable[[Run], Any] = _resume_run) -> int:
    """Write each paired run's gap into its W&B run: the whole gap curve against its baseline
    (``val/loss_gap``, ``val/loss_gap_rel`` on their own axis ``gap_step``, the step of the two
    validation losses, logged after the run's last step) and the summary keys ``loss_gap`` and
    ``loss_gap_baseline``. Runs not read through the API are skipped with a message. ``resume``
    opens a run for writing (``wandb.init(id=..., resume="must")``). Returns the runs written."""
    written = skipped = 0
    for row in rows:
        for run, bases in zip(row.runs, row.baselines):
            if run.handle is None:
                skipped += 1
                continue
            w = resume(run)
            w.define_metric("gap_step")
            w.define_metric("val/loss_gap*", step_metric="gap_step")
            for step, (gap, base) in run_gap_curve(run, bases).items():
                w.log({"gap_step": step, "val/loss_gap": gap, "val/loss_gap_rel": gap / base})
            w.summary["loss_gap"] = row.gap
            w.summary["loss_gap_baseline"] = row.baseline_loss
            w.finish()
            written += 1
    if skipped:
        log(f"--writeback: {skipped} run(s) read from files were skipped: only runs read through "
            f"the W&B API (--wandb ENTITY/PROJECT) can be updated; sync offline runs "
            f"(`wandb sync <run dir>/wandb/offline-run-*`) and rerun with --wandb.")
    if written:
        log(f"--writeback: the gap curve and loss_gap written to {written} W&B run(s).")
    return written
