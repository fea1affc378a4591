"""Scheme labels of the loss-gap report and their order.

A label is :func:`training.identity.report_label`: the scheme's name plus its ablation switches,
``quartet2[eden_correction=energy]``, the same switches a run name carries. The order is that of
:data:`quant.SCHEMES`.
"""

from __future__ import annotations

from quant import SCHEMES
from training.identity import report_label as scheme_label

BASELINE = "bf16"
"""The scheme that loss gaps are taken against unless told otherwise."""

__all__ = ["BASELINE", "scheme_key", "scheme_label"]


def scheme_key(label: str) -> tuple[int, str]:
    """Sort key of a scheme label: the order of :data:`quant.SCHEMES`, unknown names last."""
    order = list(SCHEMES)
    base = label.split("[")[0]
    return (order.index(base) if base in order else len(order), label)
