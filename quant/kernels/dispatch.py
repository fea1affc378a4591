"""Glue between :mod:`quant.linear` and the kernels: operand quantization and saved operands.

:func:`quantize_factor` is the Triton twin of ``quant.linear._quantize``: same operand, same
quantizer (MS-EDEN's ``eden_correction`` included), same draws (a
:class:`~quant.randomness.PhiloxStream` the kernel draws from itself,
or uniforms drawn from the (layer, role) generator), same delayed-amax bookkeeping. Its output values are the BF16
``q · s_block`` (the reference's FP32 values, which are exact in BF16) with the FP32 tensor scale,
or under post hoc range alignment ``(q · s_block) · s_tensor`` with no scale left to apply.

:class:`PackedFactor` stands for an operand the forward saved in packed NVFP4 form: the kernels
read its 4.5-bit codes directly (no BF16/FP32 unpacked copy), and it is unpacked (one light
kernel) only where a GEMM consumes it without re-quantization.
"""

from __future__ import annotations

import torch

from ..factor import Factor
from ..format import GROUP, PackedNVFP4
from ..randomness import PhiloxStream
from . import ops


class PackedFactor:
    """A saved :class:`PackedNVFP4` used as a GEMM factor ``values · scale`` (duck-types
    :class:`quant.factor.Factor`); ``transposed`` means the factor is the packed tensor's transpose."""

    def __init__(self, packed: PackedNVFP4, transposed: bool = False) -> None:
        self.packed, self.transposed = packed, transposed
        self.scale = packed.tensor_scale
        self._values: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            v = ops.unpack(self.packed.data, self.packed.scales, self.packed.tile == "16x16")
            self._values = v.t() if self.transposed else v
        return self._values

    def dense(self) -> torch.Tensor:
        return self.values.float() * self.scale

    @property
    def T(self) -> PackedFactor:
        return PackedFactor(self.packed, not self.transposed)


class KernelQuantized:
    """The kernel's packed output, offering ``pack()`` like an ``NVFP4Tensor``."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                 tile: str) -> None:
        self._packed = PackedNVFP4(codes, scales, tensor_scale, -1, tile)

    def pack(self) -> PackedNVFP4:
        return self._packed


def saved_factor(packed: PackedNVFP4):
    """The factor of a saved packed operand: a :class:`PackedFactor` on the kernel path."""
    return PackedFactor(packed)


def quantize_factor(src, op, signs, rng, rotation, delayed, slot: int, pack: bool, amax=None):
    """Rotate (if ``signs``) and quantize one operand along its last dim with the kernels;
    ``amax``: the operand's tensor amax when the caller knows it (``quant.linear._quantize``).

    Returns ``(factor, quantized)`` like ``quant.linear._quantize``; ``quantized`` offers
    ``pack()`` when ``pack`` is set, else is None.
    """
    from ..hadamard import rotate

    if op.quantizer == "none":  # rotation without quantization: not a preset; use the reference
        return Factor(rotate(src.dense(), signs)), None
    if isinstance(src, PackedFactor):
        p = src.packed
        x, x_scales = p.data, p.scales.view(torch.uint8)
        kind = ops.SRC_PACKED_2D if p.tile == "16x16" else ops.SRC_PACKED
        transpose, in_scale = src.transposed, p.tensor_scale.float()
        M, K = (p.data.shape[1] * 2, p.data.shape[0]) if transpose else (p.data.shape[0], p.data.shape[1] * 2)
    else:
        x, x_scales, kind, transpose = src.values, None, ops.SRC_DENSE, False
        in_scale = None if src.scale is None else src.scale.float()
        M, K = x.shape
    device = x.device
    uniforms = seed = None
    stream = 0
    if op.quantizer in ("sr", "ms_eden"):
        if isinstance(rng, PhiloxStream):
            seed, stream = rng.key, rng.stream
        else:
            shape = (M, K) if op.quantizer == "sr" else (M, K // GROUP)
            uniforms = torch.rand(shape, generator=rng, device=device)
    delayed = None if op.posthoc else delayed  # post hoc alignment has no amax to delay
    prev = None if delayed is None else delayed[slot].clone()
    # Eager calls skip the custom-op dispatcher (its overhead is per call); compiled graphs need
    # the op, which torch.compile sees as opaque through its fake implementation. There the
    # amax of a dense operand is left to inductor, which fuses the reduction into the kernel
    # that produced the operand (an RMSNorm, SwiGLU, the weight's cast) instead of reading it
    # once more (max is exact in any order, so the bits are the amax pass's).
    compiling = torch.compiler.is_compiling()
    if (amax is None and compiling and kind == ops.SRC_DENSE and signs is None and in_scale is None
            and not op.posthoc and x.numel()):  # (amax of an empty tensor is an error)
        amax = x.abs().amax()
    call = dict(x=x, mode=op.quantizer, x_scales=x_scales, src=kind, transpose=transpose,
                in_scale=in_scale, signs=signs, four_over_six=op.four_over_six,
                posthoc=op.posthoc, uniforms=uniforms, seed=seed, stream=stream, prev_amax=prev,
                amax=amax, values=True, pack=pack, eden_correction=op.eden_correction)
    values, codes, scales, st, current = (ops.quantize_operand(**call) if compiling
                                          else ops.quantize(ops.QuantizeCall(**call)))
    if delayed is not None:
        delayed[slot] = current
    q = KernelQuantized(codes, scales, st, "16x16" if op.quantizer == "rtn_2d" else "1x16") if pack else None
    return Factor(values, None if op.posthoc else st), q  # post hoc values carry s_t
