"""AdamW with the paper's parameter groups (SPEC §4): weight decay on the weights of linear layers
(block linears and lm_head), none on norms and the token embedding."""

from __future__ import annotations

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
