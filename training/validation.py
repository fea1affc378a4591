"""A run's held-out evaluations: the validation loss, its live gap to the bf16 baseline, and the
downstream lm-eval tasks.

* Validation loss: the mean loss over the same ``eval_batches`` × ``eval_batch_size`` held-out
  sequences every time (:func:`data.loader.val_batches`, the same set for any world size), under
  the run's autocast, each rank taking its share: ``val/loss``, the model's own forward, and, for
  a quantized run (``train.eval_bf16``: ``auto``, ``true``, ``false``), ``val/loss_bf16``, the same
  weights with every linear in BF16 (:func:`quant.recipe.bf16_linears`). Megatron-Core's
  ``evaluation_recipe`` does the same, as it "isolates the quality of learning from the ability to
  infer with the quantization".
* Loss gap: :class:`training.baseline.LiveGap` on the main rank, one gap row per validation at
  most (the gaps of both losses), the rest at the end of the run.
* Downstream tasks (``train.downstream_tasks`` every ``train.downstream_eval_every`` steps): an
  unquantized copy of the current master weights scored by lm-eval (:mod:`training.downstream`),
  logged as ``eval/<task>/<metric>``.

Each setting is checked when the run is built, before any training: a validation set too small
for the asked batches, or an unknown lm-eval task, stops the run at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.loader import val_batches
from data.prepare import REPO_ROOT
from data.tokenizer import Tokenizer
from model.parallel import replays_cuda_graphs
from quant.recipe import bf16_linears, quant_linears

from .baseline import BaselineError, LiveGap
from .distributed import DistInfo, all_reduce_mean
from .errors import TrainingError


@dataclass(frozen=True)
class Downstream:
    """The lm-eval tasks of a run: ``every`` steps (and at the end), on ``tasks``."""

    every: int | None
    tasks: tuple[str, ...]
    include_path: str | None = None
    limit: int | None = None

    def check(self) -> None:
        """TrainingError when ``every`` is set without tasks, or names tasks that lm-eval (with
        ``include_path``) does not know, or lm-eval is missing."""
        from . import downstream

        if self.every is not None and self.every < 1:
            raise TrainingError(f"train.downstream_eval_every must be a positive step count or null, got {self.every}.")
        if not self.tasks:
            raise TrainingError(
                "train.downstream_eval_every is set but train.downstream_tasks is empty: name lm-eval "
                "tasks, e.g. train.downstream_tasks=[hellaswag,arc_easy], or unset the interval."
            )
        try:
            downstream.check_tasks(list(self.tasks), downstream.task_manager(list(self.tasks), self.include_path))
        except (ValueError, ImportError) as err:
            raise TrainingError(str(err)) from err

    def due(self, done: int, steps: int) -> bool:
        return bool(self.every) and (done % self.every == 0 or done == steps)


def run_tokenizer(tokenizer_path: str | None, data_dir: Path) -> Tokenizer:
    """The tokenizer a run trains with: ``data.tokenizer_path``, else its dataset's own."""
    return Tokenizer(REPO_ROOT / Path(tokenizer_path).expanduser() if tokenizer_path
                     else data_dir / "tokenizer.model")


class Validation:
    """The evaluations of one run (see the module docstring). ``seq_len``, ``batch_size`` and
    ``batches``: the held-out set (``train.seq_len``, ``train.eval_batch_size``,
    ``train.eval_batches``); ``compile``/``compile_mode``: whether the model replays cudagraph
    trees, which a validation batch must step; ``model_cfg``/``tokenizer_path``: what the
    downstream copy of the model is built and tokenized with; ``bf16``: ``train.eval_bf16``, whether
    each validation also logs ``val/loss_bf16`` (``auto``: when the model has quantized linears)."""

    def __init__(self, data_dir: Path, di: DistInfo, *, seq_len: int, batch_size: int, batches: int,
                 autocast: bool, compile: bool, compile_mode: str, downstream: Downstream,
                 model_cfg: Any, tokenizer_path: str | None, bf16: bool | str = "auto") -> None:
        self.data_dir, self.di, self.autocast, self.bf16 = data_dir, di, autocast, bf16
        self.seq_len, self.batch_size, self.batches = seq_len, batch_size, batches
        self.graphs = replays_cuda_graphs(compile, compile_mode)
        self.downstream, self.model_cfg, self.tokenizer_path = downstream, model_cfg, tokenizer_path
        self.gaps: LiveGap | None = None
        try:  # the validation set is checked now, not at the first validation hundreds of steps later
            self._batches()
        except ValueError as err:
            raise TrainingError(f"train.eval_batches={batches} × train.eval_batch_size={batch_size}: {err}") from err
        if downstream.every:  # unknown tasks are found now, before any training
            downstream.check()

    def _batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return val_batches(self.data_dir, self.seq_len, self.batch_size, self.batches,
                           rank=self.di.rank, world_size=self.di.world_size)

    def track_gap(self, resolved: dict[str, Any], run_dir: Path, wandb_project: str | None,
                  logged_rows: list[dict[str, Any]] | None) -> str:
        """Start the live gap (main rank), taking up the rows already logged by a resumed run;
        returns the line that says which baseline, or why there is none."""
        try:
            self.gaps = LiveGap(resolved, run_dir, wandb_project)
        except BaselineError as err:
            raise TrainingError(str(err)) from err
        if logged_rows:
            self.gaps.resume(logged_rows)
        return self.gaps.line

    @torch.no_grad()
    def loss(self, model: torch.nn.Module) -> float:
        """Mean validation loss over the held-out batches (each rank takes its share)."""
        model.eval()
        losses = []
        device = self.di.device
        for x, y in self._batches():
            if self.graphs:  # each validation batch: the last one's graph outputs are consumed
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                losses.append(model(x.to(device), y.to(device)).float())
        model.train()
        return all_reduce_mean(torch.stack(losses).mean()).item()

    def losses(self, model: torch.nn.Module) -> dict[str, float]:
        """``val/loss``, and ``val/loss_bf16`` when asked for (see the class docstring)."""
        out = {"val/loss": self.loss(model)}
        if self.bf16 is True or (self.bf16 == "auto" and quant_linears(model)):
            with bf16_linears(model):
                out["val/loss_bf16"] = self.loss(model)
        return out

    def with_gap(self, step: int, metrics: dict[str, Any], say: Any) -> dict[str, Any]:
        """``metrics`` of a validation step, with a loss gap when one is ready to log; ``say``
        prints the line of a baseline found just now."""
        if self.gaps is None:
            return metrics
        row, found = self.gaps.at_validation(step, metrics["val/loss"], metrics.get("val/loss_bf16"))
        if found:
            say(found)
        return metrics | row

    def downstream_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """The downstream tasks on the current master weights, as ``eval/<task>/<metric>``.

        Every rank takes part in gathering the full (unsharded) state dict; the main rank then
        builds an unquantized copy of the model on the run's device, evaluates it and returns the
        metrics; the other ranks return ``{}``. The training model is left as it was."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from model import build_model

        from . import downstream

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.di.is_main:
            return {}
        copy = build_model(self.model_cfg, device="cpu")
        copy.load_state_dict(state)
        results = downstream.evaluate(
            copy.to(self.di.device), run_tokenizer(self.tokenizer_path, self.data_dir), list(self.downstream.tasks),
            include_path=self.downstream.include_path, limit=self.downstream.limit,
        )
        return {f"eval/{task}/{name}": value for task, metrics in results.items() for name, value in metrics.items()}

    def final_gap(self, steps: int, run_dir: Path, tracker: Any) -> dict[str, Any]:
        """At the end of the run: log the gaps still owed, say what the final gap is (or which
        steps the baseline has not validated yet), and return the summary's gap entries."""
        gaps = self.gaps
        if gaps is None or not gaps.active:
            return {}
        tracker.log_after(steps, gaps.remaining())
        if gaps.baseline is None:
            tracker.info(f"loss gap: none, no bf16 baseline was found; `python scripts/compare_runs.py "
                         f"{run_dir.parent}` reports the gaps once a bf16 run with the same settings exists")
            return {}
        final_gap = gaps.final(steps)
        out = {} if final_gap is None else {"loss_gap": final_gap, "loss_gap_baseline": gaps.baseline.where}
        if (final_bf16 := gaps.final_bf16(steps)) is not None:
            out["loss_gap_bf16"] = final_bf16
        if missing := gaps.missing():
            tracker.info(f"loss gap: the baseline has no validation loss yet at step(s) {missing}; "
                         f"`python scripts/compare_runs.py {run_dir.parent}` reports them once it has")
        elif final_gap is not None:
            tracker.info(f"loss gap at step {steps}: {final_gap:+.4f} against {gaps.baseline.where}")
        return out
