"""The operand of an emulated or native NVFP4 GEMM, shared by :mod:`quant.linear` and the kernels.

A :class:`Factor` is one side of a GEMM ``A · Bᵀ`` (SPEC §3), laid out rows × reduction, as
``values · scale``. It imports nothing from the rest of the package but :mod:`quant.format`, so
that :mod:`quant.linear` and :mod:`quant.kernels.dispatch` can both build factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import NVFP4Tensor, PackedNVFP4


@dataclass
class Factor:
    """A GEMM operand as ``values · scale``: ``values`` (rows × reduction) and an FP32 tensor
    scale, or ``scale=None`` for a plain high-precision tensor. A saved operand keeps its
    ``packed`` form (``transposed``: the factor is its transpose), which native GEMMs read.

    For an NVFP4 operand (SPEC §1) ``values`` are the exact ``q · s_block`` and ``scale`` is
    ``s_tensor``, which the GEMM applies once to its FP32 sum (:func:`quant.linear._product`).
    Under post hoc range alignment (SPEC §6.1), whose tensor scale is a power of two, the values
    carry it, ``(q · s_block) · s_tensor``, and ``scale`` is None."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    packed: PackedNVFP4 | None = None
    transposed: bool = False

    def dense(self) -> torch.Tensor:
        v = self.values.float()
        return v if self.scale is None else v * self.scale

    @property
    def T(self) -> Factor:
        return Factor(self.values.t(), self.scale, self.packed, not self.transposed)

    @classmethod
    def of(cls, t: NVFP4Tensor) -> Factor:
        return cls(t.scaled_values(), t.tensor_scale)
