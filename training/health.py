"""The per-step health check: a non-finite loss, gradient norm or parameter stops the run at the
step where it appears, before anything is saved or logged for that step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from .distributed import all_reduce_max


def param_max_abs(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """max |p| over the parameters, over all ranks' shards: finite exactly when every parameter
    is (NaN propagates through the max). One fused pass, no host synchronisation."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    local = [t.detach() for t in local if t.numel()]
    return all_reduce_max(get_total_norm(local, norm_type=math.inf, foreach=True).float())


def first_nonfinite(loss: float, grad_norm: float, param_max: float) -> str | None:
    """What went non-finite first in a step, in the order it is computed, or None."""
    if not math.isfinite(loss):
        return f"the training loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm} (the loss, {loss:.4f}, is finite)"
    if not math.isfinite(param_max):
        return "a parameter is non-finite after the optimizer step (loss and gradient norm are finite)"
    return None
