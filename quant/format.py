"""The NVFP4 format: E2M1 elements, E4M3 block scales, an FP32 tensor scale (SPEC §1).

A quantized tensor is held in two forms that dequantize to the same bits:

* :class:`NVFP4Tensor`, the emulation form: E2M1 values ``q`` as float32, block scales as
  float32 values that are exactly representable in E4M3, and the FP32 tensor scale.
* :class:`PackedNVFP4`, the storage form: two 4-bit E2M1 codes per byte, the block scales as
  ``torch.float8_e4m3fn`` and the FP32 tensor scale (4.5 bits per element for 1×16 groups).

Dequantization is ``x̂ = (q · s_block) · s_tensor`` in float32 (SPEC §1). ``q · s_block`` is exact in
float32 and in bfloat16 (at most 5 significant bits), so the only rounding is the final product
with the tensor scale, and both forms perform it identically.

Groups always run along the last dimension of the stored tensor; quantizers move the grouping
dimension there first (``NVFP4Tensor.dim`` records where it came from).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

GROUP = 16
"""Elements per micro-scale group (SPEC §1)."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The eight E2M1 magnitudes; the index is the 3-bit magnitude code."""

# Midpoints between neighbouring grid points. A value exactly on midpoint i (between codes i and
# i+1) rounds to the even code: down when i is even, up when i is odd (ties to even, SPEC §1).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_code_magnitude(a: torch.Tensor) -> torch.Tensor:
    """3-bit magnitude code (0..7) of ``|x|`` rounded to nearest E2M1, ties to even, saturating at 6.

    ``a`` must be non-negative; NaN gets code 0. Returns uint8 codes (the count of midpoints below
    ``a``, a tie counting when its upper neighbour is the even code).
    """
    code = (a > _MIDPOINTS[0]).to(torch.uint8)
    for i, m in enumerate(_MIDPOINTS[1:], start=1):
        code += (a > m) if i % 2 == 0 else (a >= m)
    return code


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to even, saturating at ±6 (SPEC §1).

    Returns float32 values on the E2M1 grid with the sign of ``x`` (``-0.0`` for small negatives;
    ``+0.0`` for every NaN bit pattern, quiet or signalling, of either sign). Below 1 the grid is
    the multiples of 0.5, so ``round(2|x|)/2`` (torch rounds half to even); from 1 up it is FP32
    with one mantissa bit, so the FP32 bit pattern is rounded to its top mantissa bit (add half
    an ulp, minus one unless the kept bit is odd) and saturated. NaN becomes 0 before that
    integer rounding, which would carry a NaN's mantissa into its exponent (to ±inf, or past the
    sign bit).
    """
    x = x.float()
    a = x.abs().nan_to_num_(nan=0.0, posinf=math.inf)
    b = a.view(torch.int32)
    one_bit = ((b + 0x1FFFFF + ((b >> 22) & 1)) & -0x400000).view(torch.float32)
    mag = torch.where(a < 1, torch.round(a * 2) * 0.5, one_bit).clamp_(max=E2M1_MAX)
    return torch.where(x < 0, -mag, mag)


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign bit 3, magnitude bits 0-2) of values already on the E2M1 grid, as uint8."""
    return (torch.signbit(q).to(torch.uint8) << 3) | e2m1_code_magnitude(q.abs())


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of packed bytes along the last dim: element ``2i`` from the low nibble of
    byte ``i``, ``2i+1`` from its high nibble (:meth:`NVFP4Tensor.pack`'s order)."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim (even length): element ``2i`` in the low
    nibble of byte ``i``, ``2i+1`` in its high nibble (inverse of :func:`unpack_codes`)."""
    if codes.shape[-1] % 2:
        raise ValueError("packing needs an even number of elements along the grouped dim")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of 4-bit E2M1 codes (inverse of :func:`encode_e2m1`)."""
    codes = codes.to(torch.int64)
    mag = E2M1_GRID.to(codes.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value (ties to even, subnormals included), saturating at ±448.

    The clamp comes first: torch ≥ 2.13 saturates on its own, older releases return NaN.
    """
    x = x.float()
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def e4m3_block_scale(raw: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale of a non-negative raw scale, with a zero scale replaced by 1 (SPEC §1)."""
    s = round_e4m3(raw)
    return torch.where(s == 0, torch.ones_like(s), s)


def round_e4m3_mantissa(x: torch.Tensor) -> torch.Tensor:
    """Non-negative FP32 ``x`` rounded to E4M3's 3 mantissa bits (nearest, ties to even) with
    FP32's exponent range: an E4M3 value up to a power of two. (Integer rounding of the bit
    pattern: add half an ulp of the 3-bit mantissa, minus one unless the kept bit is odd.)"""
    b = x.float().view(torch.int32)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000
    return b.view(torch.float32)


def pow2_scale_for(c_max: torch.Tensor, target: float = E4M3_MAX) -> torch.Tensor:
    """The smallest power of two ``s`` with ``c_max / s ≤ target`` (``target`` = m·2^j with
    m ∈ [1, 2); FP32 0-dim; 1 when ``c_max`` is 0, NaN when it is NaN or +inf, for which no
    power of two serves): the post hoc tensor scale of MS-EDEN, which keeps ``c / s`` exact and
    on E4M3's mantissa grid when ``c`` is."""
    c_max = c_max.float()
    b = c_max.view(torch.int32)
    t = struct.unpack("<i", struct.pack("<f", target))[0]  # target's FP32 bit pattern
    exp = (b >> 23) - (t >> 23)
    k = torch.clamp(exp + ((b & 0x7FFFFF) > (t & 0x7FFFFF)).to(torch.int32), min=-126)
    s = ((k + 127) << 23).view(torch.float32)
    s = torch.where(c_max > 0, s, torch.ones_like(s))
    return torch.where(c_max < math.inf, s, torch.full_like(s, math.nan))


def e4m3_neighbours(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 values ``down ≤ c ≤ up`` that bracket a non-negative ``c`` (clamped to 448).

    When ``c`` is representable, ``down == up == c``. Positive E4M3 bit patterns are ordered like
    integers, so the neighbour of a rounded value is one bit pattern away.
    """
    c = c.float().clamp(0.0, E4M3_MAX)
    r = c.to(torch.float8_e4m3fn)
    bits = r.view(torch.uint8).to(torch.int16)
    rf = r.float()
    below = (bits - 1).clamp(min=0).to(torch.uint8).view(torch.float8_e4m3fn).float()
    above = (bits + 1).clamp(max=0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
    down = torch.where(rf > c, below, rf)
    up = torch.where(rf < c, above, rf)
    return down, up


FP32_MIN_POSITIVE = math.ldexp(1.0, -149)
"""2^-149, FP32's smallest positive (subnormal) value: the floor of every tensor scale."""


def tensor_scale(amax: torch.Tensor, target: float) -> torch.Tensor:
    """FP32 tensor scale ``s_t = max(amax / target, 2^-149)`` (SPEC §2); 1 for an all-zero
    tensor, NaN for an amax that is NaN or +inf (then no scale is meaningful, and
    ``x̂ = q · s_b · s_t`` is NaN in every element: the non-finite rule of :mod:`quant.quantizers`).

    The floor (``docs/spec.md`` §2, the constants): below ``amax ≈ target · 2^-150``
    (1.9e-42 for RTN's 6·448) the quotient rounds to 0, and a zero tensor scale makes the raw
    block scale of an all-zero group ``0 / 0``, NaN. 2^-149 is the nearest FP32 value that is not
    0, so the floor changes only tensor scales that would be 0.

    The divisor is a float32 tensor: CUDA turns division by a Python float into a multiplication
    by its reciprocal, which can differ from true division in the last bit.
    """
    amax = amax.float()
    s = (amax / fp32(target, amax.device)).clamp_(min=FP32_MIN_POSITIVE)
    s = torch.where(amax > 0, s, torch.ones_like(amax))
    return torch.where(amax < math.inf, s, torch.full_like(s, math.nan))


def fp32(value: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``value`` as a 0-dim float32 tensor, so that ``x / fp32(c)`` is a true division on any device."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def check_groupable(n: int, what: str = "dimension", group: int = GROUP) -> None:
    """Raise a clear error when a grouped dimension does not divide by the group size."""
    if n % group != 0:
        raise ValueError(
            f"{what} has size {n}, which is not divisible by {group}: NVFP4 groups {group} "
            f"consecutive elements along the reduction dimension. Pad or resize it to a multiple "
            f"of {group}."
        )


def to_groups(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """View ``x`` (last dim divisible by ``group``) as ``(..., n // group, group)``."""
    check_groupable(x.shape[-1], "the grouped (last) dimension", group)
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


@dataclass
class NVFP4Tensor:
    """Emulation form of a quantized tensor, groups along the last dimension of ``q``.

    Attributes:
        q: E2M1 values (float32) in the grouped layout, i.e. with the grouping dim moved last.
        block_scale: E4M3-representable float32 scales, ``q.shape[:-1] + (n // 16,)`` for 1×16
            groups, or ``(rows // 16, cols // 16)`` for 16×16 tiles of a 2-D ``q``.
        tensor_scale: FP32 0-dim tensor.
        dim: the dimension of the original tensor that was grouped (moved back on dequantize).
        tile: ``"1x16"`` or ``"16x16"``.
    """

    q: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    dim: int = -1
    tile: str = "1x16"

    def expanded_scale(self) -> torch.Tensor:
        """Block scales broadcast to the shape of ``q``."""
        if self.tile == "16x16":
            return self.block_scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
        return self.block_scale.repeat_interleave(GROUP, -1)

    def scaled_values(self) -> torch.Tensor:
        """``q · s_block`` in the grouped layout (exact in float32 and bfloat16)."""
        return self.q * self.expanded_scale()

    def dequantize_grouped(self) -> torch.Tensor:
        """``x̂ = (q · s_block) · s_tensor`` in the grouped layout (grouping dim last)."""
        return self.scaled_values() * self.tensor_scale

    def dequantize(self) -> torch.Tensor:
        """``x̂`` in the original layout of the quantized tensor."""
        return self.dequantize_grouped().movedim(-1, self.dim)

    def pack(self) -> PackedNVFP4:
        """The storage form: two E2M1 codes per byte, E4M3 scales, FP32 tensor scale."""
        return PackedNVFP4(
            data=pack_codes(encode_e2m1(self.q)),
            scales=self.block_scale.to(torch.float8_e4m3fn),
            tensor_scale=self.tensor_scale.float().clone(),
            dim=self.dim,
            tile=self.tile,
        )


@dataclass
class PackedNVFP4:
    """Storage form of :class:`NVFP4Tensor`: uint8 ``data`` holds element ``2i`` in the low nibble
    and ``2i+1`` in the high nibble; ``scales`` are ``float8_e4m3fn``."""

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    dim: int = -1
    tile: str = "1x16"

    def pack(self) -> PackedNVFP4:
        """Itself: the packed form of a packed tensor (as :meth:`NVFP4Tensor.pack` gives it)."""
        return self

    def unpack(self) -> NVFP4Tensor:
        return NVFP4Tensor(
            q=decode_e2m1(unpack_codes(self.data)),
            block_scale=self.scales.float(),
            tensor_scale=self.tensor_scale,
            dim=self.dim,
            tile=self.tile,
        )

    def dequantize(self) -> torch.Tensor:
        return self.unpack().dequantize()

    def transposed(self) -> PackedNVFP4:
        """The transpose of a 16×16-tile tensor, still packed: the codes move (unpacked to one
        per byte, transposed, packed again; no value is decoded or re-encoded) and the tile
        scales transpose, since a 16×16 tile is also a tile of the transpose (SPEC §3, the
        weight's 16×16 quantization serves the forward and dgrad)."""
        if self.tile != "16x16":
            raise ValueError(
                f"only 16x16-tile tensors transpose as NVFP4 (their 1x16 groups would run across "
                f"the new rows); this one has tile={self.tile!r}: quantize the transpose instead"
            )
        return PackedNVFP4(
            data=pack_codes(unpack_codes(self.data).t().contiguous()),
            scales=self.scales.t().contiguous(),
            tensor_scale=self.tensor_scale,
            dim=self.dim,
            tile=self.tile,
        )

    def nbytes(self) -> int:
        """Bytes of storage (codes + scales + tensor scale)."""
        return self.data.numel() + self.scales.numel() + 4
