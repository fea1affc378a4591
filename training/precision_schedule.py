"""The late switch to BF16: from one optimizer step on, the quantized linears run their forward
GEMMs (or all their GEMMs) in BF16.

NVIDIA's 12B NVFP4 run (arXiv 2509.25149) switches to BF16 near the end of training, which
closes most of the remaining loss gap; switching the forward GEMMs only takes its relative gap
from 1.5% to 0.5% for about 6% of the compute, and torchtitan's NVFP4 guide switches the forward
shortly before the learning-rate decay. ``quant.schedule`` (configs/quant/base/switches.yaml):

* ``at``: the switch point, a step count (an int: steps 0..at-1 run as the recipe says, step
  ``at`` and later switched) or a fraction of the budget (a float in (0, 1): ``0.8`` switches the
  last 20% of the steps, at step ``round(0.8 × steps)``); null: no switch. The switch must leave
  at least one step on each side.
* ``precision``: ``bf16_forward`` (the forward GEMMs; the backward keeps the scheme's
  quantization, :func:`quant.schemes.bf16_gemms`) or ``bf16`` (all three GEMMs).

The switch is a function of the step alone (:meth:`PrecisionSwitch.active`), so a run resumed
after the switch point is switched before its first step, and a run stopped on either side of it
resumes bit-exactly. The trainer applies it at the top of the step (training/trainer.py), then
tells the step (:meth:`training.step.TrainStep.precision_changed`): a captured CUDA graph of the
step is dropped and captured again after its warm-up steps, and compiled blocks recompile once,
their guards seeing the changed scheme.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

SWITCH_PRECISIONS = ("bf16_forward", "bf16")
"""What ``quant.schedule.precision`` can switch the quantized linears to."""

DEFAULT_PRECISION = "bf16_forward"
"""``quant.schedule.precision`` when a schedule leaves it out (configs/quant/base/switches.yaml)."""

LABELS = {"bf16_forward": "fwdbf16", "bf16": "bf16"}
"""A switch's precision in a run name (:func:`switch_label`)."""


@dataclass(frozen=True)
class PrecisionSwitch:
    """From 0-based optimizer step ``step`` on, the quantized linears run under ``precision``."""

    step: int
    precision: str

    def active(self, step: int) -> bool:
        return step >= self.step


def _at(schedule: Mapping[str, Any] | None) -> Any:
    return None if not schedule else schedule.get("at")


def switch_from_config(quant_cfg: Mapping[str, Any], steps: int) -> PrecisionSwitch | None:
    """The switch that ``quant_cfg["schedule"]`` asks for in a run of ``steps`` optimizer steps,
    or None; a switch point outside the budget, or an unknown precision, is a ConfigError."""
    schedule = quant_cfg.get("schedule")
    at = _at(schedule)
    if at is None:
        return None
    precision = schedule.get("precision", DEFAULT_PRECISION)
    if precision not in SWITCH_PRECISIONS:
        raise ConfigError(f"quant.schedule.precision={precision!r} is not a switch target. Fix: one of "
                          f"{', '.join(SWITCH_PRECISIONS)}.")
    fix = (f"Fix: quant.schedule.at=S with 1 ≤ S ≤ {steps - 1} (a step), or a fraction of the budget in (0, 1), "
           f"e.g. 0.8 for the last 20% of the steps; or quant.schedule.at=null (no switch).")
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise ConfigError(f"quant.schedule.at={at!r} is neither a step nor a fraction of the budget. {fix}")
    if isinstance(at, float) and not 0 < at < 1:
        raise ConfigError(f"quant.schedule.at={at} is a fraction outside (0, 1). {fix}")
    step = round(at * steps) if isinstance(at, float) else at
    if not 1 <= step < steps:
        where = f"{at} of {steps} steps is step {step}" if isinstance(at, float) else f"step {at}"
        raise ConfigError(f"quant.schedule.at={at}: {where}, outside the run's {steps} steps, so no step "
                          f"would run on one side of the switch. {fix}")
    return PrecisionSwitch(step, precision)


def switch_label(schedule: Mapping[str, Any] | None) -> str | None:
    """The switch in a run name, ``fwdbf16@80%`` (a fraction) or ``bf16@2400`` (a step); None
    without one."""
    at = _at(schedule)
    if at is None:
        return None
    label = LABELS.get(schedule.get("precision", DEFAULT_PRECISION), str(schedule.get("precision")))
    return f"{label}@{at * 100:g}%" if isinstance(at, float) else f"{label}@{at}"
