"""Scheme labels of the loss-gap report: a scheme's name plus its ablation switches, and their order.

The switches and their defaults come from :data:`quant.ABLATIONS` (the keyword arguments of
``quant.get_scheme``, SPEC §3) plus ``keep_edge_blocks``; the order is that of :data:`quant.SCHEMES`.
"""

from __future__ import annotations

from typing import Any

from quant import ABLATIONS, SCHEMES

BASELINE = "bf16"
"""The scheme that loss gaps are taken against unless told otherwise."""

LABEL_DEFAULTS: dict[str, Any] = {**ABLATIONS, "keep_edge_blocks": None}
"""``quant.<key>`` values that leave a scheme unlabelled; any other value labels it."""


def scheme_label(name: str | None, quant_cfg: dict | None) -> str | None:
    """The scheme's name, plus ``[key=value,...]`` for every ablation switch off its default.

    An identity scheme (``bf16``) keeps its bare name: ablation switches change nothing there.
    """
    if name is None or not isinstance(quant_cfg, dict):
        return name
    if name in SCHEMES and SCHEMES[name].is_identity:
        return name
    extra = [f"{k}={quant_cfg[k]}" for k, default in LABEL_DEFAULTS.items()
             if k in quant_cfg and quant_cfg[k] != default]
    return f"{name}[{','.join(extra)}]" if extra else name


def scheme_key(label: str) -> tuple[int, str]:
    """Sort key of a scheme label: the order of :data:`quant.SCHEMES`, unknown names last."""
    order = list(SCHEMES)
    base = label.split("[")[0]
    return (order.index(base) if base in order else len(order), label)
