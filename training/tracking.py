"""Logging of a run: plain log lines (file + stdout), a progress bar on terminals, a local metrics
file (``metrics.jsonl``) and Weights & Biases; and the throughput, MFU and memory metrics that the
log lines carry (:class:`Throughput`).

``metrics.jsonl`` holds one JSON object a line, and every row has ``"step"``: the optimizer step
its values belong to (0 is the validation at initialisation). A loss gap belongs to the step of the
two validation losses it compares, ``gap_step`` (:mod:`training.baseline`); when it is found at a
later validation, or at the end of the run, it is a row of its own, ``{"step": gap_step,
"gap_step": gap_step, "val/loss_gap": ..., "val/loss_gap_rel": ...}``, written when it is found.
W&B keeps its axes: the gap is logged with the step at which it was found, plotted against
``gap_step``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("train")

GAP_STEP = "gap_step"
GAP_PREFIX = "val/loss_gap"
"""The keys of a loss gap (:mod:`training.baseline`): its step, and its values."""

# Dense BF16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets.
BF16_PEAK_FLOPS = {
    "B200": 2.25e15,
    "B100": 1.75e15,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


def bf16_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The BF16 peak of ``device`` (FLOP/s), ``override`` if given, or None if unknown (CPU)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation against the BF16 peak: ``flops_per_token · tokens/s / peak``."""
    return None if not peak else flops_per_token * tokens_per_second / peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident set size of the process on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput:
    """The ``perf/`` metrics of a log line, over the steps since the previous one: tokens/s (all
    ranks, and per rank), MFU against the BF16 peak (:func:`mfu`), peak memory and the time left."""

    def __init__(self, device: torch.device, flops_per_token: float, world_size: int, tokens_per_step: int,
                 peak_flops: float | None = None) -> None:
        self.device, self.flops_per_token, self.world_size = device, flops_per_token, world_size
        self.tokens_per_step, self.peak = tokens_per_step, bf16_peak_flops(device, peak_flops)
        self.restart()

    def restart(self) -> None:
        """Count from now (after a log line)."""
        self.t0, self.tokens = time.perf_counter(), 0

    def step(self) -> None:
        self.tokens += self.tokens_per_step

    def metrics(self, steps_left: int) -> dict[str, Any]:
        """The metrics since :meth:`restart`; call after the GPU has caught up."""
        tps = self.tokens / (time.perf_counter() - self.t0)
        return {
            "perf/tokens_per_s": tps,
            "perf/tokens_per_s_per_rank": tps / self.world_size,
            "perf/mfu_vs_bf16_peak": mfu(self.flops_per_token, tps / self.world_size, self.peak),
            "perf/peak_memory_gib": peak_memory_gib(self.device),
            "perf/eta_min": steps_left * self.tokens_per_step / tps / 60,
        }


def wandb_mode(requested: str) -> str:
    """``online``/``offline``/``disabled``; ``auto`` is online only when an API key is present."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def interactive() -> bool:
    """A progress bar only on a terminal and outside Slurm batch jobs."""
    return sys.stderr.isatty() and "SLURM_JOB_ID" not in os.environ


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics that have a value (a non-finite value is kept: it is what happened)."""
    return {k: v for k, v in metrics.items() if v is not None}


def _postfix(metrics: dict[str, Any], last_val: float | None) -> str:
    """The progress bar's text: the step's loss, the latest throughput and validation loss."""
    parts = []
    if metrics.get("train/loss") is not None:
        parts.append(f"loss={metrics['train/loss']:.4f}")
    if metrics.get("perf/tokens_per_s"):
        parts.append(f"tok/s={metrics['perf/tokens_per_s']:.0f}")
    if last_val is not None:
        parts.append(f"val={last_val:.4f}")
    return " ".join(parts)


def _wandb_note(run: Any, mode: str) -> str:
    """One line on where the W&B run is, in the run's own words."""
    if mode == "offline":
        folder = Path(run.dir).parent
        return f"W&B: offline run in {folder}; upload it later with: wandb sync {folder}"
    url = getattr(run, "url", None)
    return f"W&B: {url}" if url else f"W&B: run {run.id} ({mode})"


class Tracker:
    """One run's outputs. ``run_id`` is the W&B run id stored in checkpoints, so a resumed run
    continues the same W&B run."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        name: str,
        group: str,
        wandb_cfg: dict[str, Any],
        run_id: str | None,
        total_steps: int,
        start_step: int,
    ) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        self._handler = handler
        if not any(isinstance(h, logging.StreamHandler) and h.stream is sys.stdout for h in log.handlers):
            out = logging.StreamHandler(sys.stdout)
            out.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(out)
        log.setLevel(logging.INFO)
        log.propagate = False
        log.disabled = False  # Hydra disables loggers created before it configured logging
        self._metrics = open(run_dir / "metrics.jsonl", "a")
        self.wandb = None
        self.run_id = run_id
        self.wandb_note: str | None = None
        mode = wandb_mode(wandb_cfg.get("mode", "auto")) if wandb_cfg.get("enabled", True) else "disabled"
        if mode != "disabled":
            import wandb

            self.run_id = run_id or uuid.uuid4().hex[:12]
            self.wandb = wandb.init(
                project=wandb_cfg.get("project"),
                entity=wandb_cfg.get("entity"),
                name=name,
                group=group,
                tags=list(wandb_cfg.get("tags") or []),
                id=self.run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                mode=mode,
                settings=wandb.Settings(quiet=True, silent=True),
            )
            self.wandb_note = _wandb_note(self.wandb, mode)
            # Loss gaps have their own axis: a gap can be logged after the step it belongs to.
            self.wandb.define_metric("gap_step")
            self.wandb.define_metric("val/loss_gap*", step_metric="gap_step")
        self.wandb_project = (f"{self.wandb.entity}/{self.wandb.project}" if self.wandb is not None
                              and mode == "online" else None)
        self.bar = None
        self.last_val: float | None = None
        if interactive():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _line(self, msg: str, above_bar: bool) -> None:
        """``msg`` to train.log, and to stdout; with a progress bar, stdout only if ``above_bar``."""
        if self.bar is None:
            log.info(msg)
            return
        self._handler.emit(logging.LogRecord("train", logging.INFO, "", 0, msg, None, None))
        if above_bar:
            self.bar.write(msg)

    def info(self, msg: str) -> None:
        self._line(msg, above_bar=True)

    def _write(self, step: int, metrics: dict[str, Any]) -> None:
        """``metrics`` to metrics.jsonl as the row(s) of the step each value belongs to."""
        gap_step = metrics.get(GAP_STEP)
        if gap_step is not None and gap_step != step:
            gap = {k: v for k, v in metrics.items() if k == GAP_STEP or k.startswith(GAP_PREFIX)}
            metrics = {k: v for k, v in metrics.items() if k not in gap}
            if metrics:
                self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
            self._metrics.write(json.dumps({"step": gap_step, **gap}) + "\n")
        else:
            self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics.flush()

    def log(self, step: int, metrics: dict[str, Any], line: bool = True) -> None:
        metrics = _clean(metrics)
        self._write(step, metrics)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if "val/loss" in metrics:
            self.last_val = metrics["val/loss"]
        if self.bar is not None and (line or self.bar.postfix is None):
            self.bar.set_postfix_str(_postfix(metrics, self.last_val), refresh=False)
        if not line:
            return
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        self._line(f"step {step} {text}", above_bar=False)

    def log_after(self, last_step: int, rows: list[dict[str, Any]]) -> None:
        """Loss gaps filled in at the end of the run: to metrics.jsonl as rows of their
        ``gap_step``, to W&B after ``last_step`` (their axis is ``gap_step``)."""
        for i, row in enumerate(rows):
            row = _clean(row)
            self._write(last_step + 1 + i, row)
            if self.wandb is not None:
                self.wandb.log(row, step=last_step + 1 + i)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def summary(self, values: dict[str, Any]) -> None:
        values = _clean(values)
        with open(self.run_dir / "summary.json", "w") as f:
            json.dump(values, f, indent=2)
        if self.wandb is not None:
            for k, v in values.items():
                self.wandb.summary[k] = v

    def finish(self, exit_code: int = 0) -> None:
        if self.bar is not None:
            self.bar.close()
        self._metrics.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
        log.removeHandler(self._handler)
        self._handler.close()


class NullTracker:
    """What ranks other than 0 use: nothing is written or printed."""

    run_id = None
    wandb_project = None

    def info(self, msg: str) -> None:
        pass

    def log_after(self, last_step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def log(self, step: int, metrics: dict[str, Any], line: bool = True) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
