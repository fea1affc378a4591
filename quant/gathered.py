"""The weight of a quantized linear as FSDP2 gathers it in NVFP4: Ŵ, packed, in a tensor.

Under ``parallel.weight_gather=nvfp4`` (:mod:`quant.fsdp_gather`) FSDP2 all-gathers each rank's
quantized shard, packed codes and E4M3 block scales, and builds the unsharded parameter from
them. That parameter is a :class:`GatheredNVFP4Weight`: it has the weight's shape and compute
dtype, so autograd and FSDP2 treat it as the weight (its gradient is an ordinary tensor of that
shape, reduce-scattered as usual), but it holds only Ŵ (SPEC §1: codes, block scales, tensor
scale), which :class:`~quant.linear.QuantLinear` hands to the GEMMs as the forward's quantized
weight. Its values are never read as a dense weight: any operation other than the aliasing ones
FSDP2 applies raises an error naming it. A layer whose GEMMs need W itself (its forward switched
to BF16, a validation with BF16 linears; :mod:`quant.recipe`) takes it with :meth:`whole`, an
explicit all-gather of the shards in the same dtype as the BF16 gather, so it computes exactly
as under ``weight_gather=bf16``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .format import PackedNVFP4
from .schemes import Operand

aten = torch.ops.aten

_WHOLE = (aten.detach.default, aten.alias.default)
_ALIASES = (*_WHOLE, aten.as_strided.default, aten.view.default)
"""What FSDP2 does to the unsharded parameter it builds (``as_strided`` to its size,
``nn.Parameter``'s ``detach``): views of the whole tensor (``as_strided`` and ``view`` only to
its own shape), which keep Ŵ."""


class GatheredNVFP4Weight(torch.Tensor):
    """An ``out × in`` weight that holds its NVFP4 form Ŵ only (module docstring).

    ``codes``: uint8 ``out × in/2``; ``scales``: float8_e4m3fn ``out × in/16`` (1×16 groups) or
    ``out/16 × in/16`` (16×16 tiles); ``tensor_scale``: FP32 0-dim; ``dtype``: the dtype the
    unsharded weight would have had (FSDP2's ``param_dtype``); ``operand``: the forward weight
    quantizer that made Ŵ (SPEC §3); ``shard``: this rank's shard of W, whose ``whole(dtype)``
    all-gathers W (:mod:`quant.fsdp_gather`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    tile: str
    operand: Operand
    shard: Any

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, tile: str,
                dtype: torch.dtype, operand: Operand, shard: Any = None, shape=None) -> GatheredNVFP4Weight:
        shape = (codes.shape[0], codes.shape[1] * 2) if shape is None else shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, tile: str,
                 dtype: torch.dtype, operand: Operand, shard: Any = None, shape=None) -> None:
        self.codes, self.scales, self.tensor_scale, self.tile = codes, scales, tensor_scale, tile
        self.operand, self.shard = operand, shard

    @property
    def packed(self) -> PackedNVFP4:
        """Ŵ as the GEMMs read it (:func:`quant.linear.quantized_gemm`'s ``b_quantized``)."""
        return PackedNVFP4(self.codes, self.scales, self.tensor_scale, -1, self.tile)

    def serves(self, operand: Operand) -> bool:
        """Whether Ŵ is what a forward weight quantizer ``operand`` makes of W."""
        return operand == self.operand

    def whole(self) -> torch.Tensor:
        """W itself, all-gathered from the shards (module docstring); its gradient is this
        weight's."""
        return _WholeWeight.apply(self)

    def _like(self, shape) -> GatheredNVFP4Weight:
        return GatheredNVFP4Weight(self.codes, self.scales, self.tensor_scale, self.tile, self.dtype, self.operand,
                                   self.shard, shape)

    def __repr__(self) -> str:
        return f"GatheredNVFP4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, tile={self.tile})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["codes", "scales", "tensor_scale"], (self.tile, self.dtype, self.operand, self.shard)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size, outer_stride):
        return GatheredNVFP4Weight(inner["codes"], inner["scales"], inner["tensor_scale"], *ctx, outer_size)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func in _ALIASES and (func in _WHOLE or tuple(args[1]) == tuple(self.shape)):
            return self._like(self.shape)
        raise RuntimeError(
            f"{func} on {self!r}, the FSDP2-gathered weight of a quantized linear: under "
            f"parallel.weight_gather=nvfp4 it holds only its forward NVFP4 form Ŵ, which the "
            f"layer's GEMMs read. Fix: read the weight outside the forward and backward (the "
            f"sharded parameter holds W), or train with parallel.weight_gather=bf16."
        )


class _WholeWeight(torch.autograd.Function):
    """W from its shards (:meth:`GatheredNVFP4Weight.whole`); the gradient passes to the
    gathered weight unchanged, as FSDP2 reduce-scatters it."""

    @staticmethod
    def forward(ctx, w: GatheredNVFP4Weight) -> torch.Tensor:  # type: ignore[override]
        hp, group = w.shard.hp.to(w.dtype), w.shard.group
        out = torch.empty(w.shape, dtype=w.dtype, device=hp.device)
        dist.all_gather_into_tensor(out, hp.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad
