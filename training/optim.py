"""The optimizer recipe of SPEC §4: AdamW with the paper's parameter groups (weight decay on the
weights of linear layers, block linears and lm_head; none on norms and the token embedding), and
its learning-rate schedule (linear warmup from lr/100 over the first 10% of steps, then cosine
decay to lr/10 at the last step)."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: linear weights (decayed) and everything else (norm scales, embedding)."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(
    model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; ``fused`` on CUDA."""
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, fused=fused
    )


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_frac: float = 0.1, start_ratio: float = 0.01,
          final_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup: ``lr(s) = peak · (r0 + (1 − r0) · s / W)`` for ``s < W = ⌈warmup_frac · total⌉``, with
    ``r0 = start_ratio``. Decay: ``lr(s) = peak · (rf + (1 − rf) · (1 + cos(π·p)) / 2)`` with
    ``p = (s − W) / (total − 1 − W)`` going from 0 to 1 and ``rf = final_ratio``.
    """
    warmup = math.ceil(warmup_frac * total_steps)
    if step < warmup:
        return peak_lr * (start_ratio + (1 - start_ratio) * step / warmup)
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
