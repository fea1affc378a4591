"""A CPU simulator of the native NVFP4 scaled matmul, fed exactly what a native call gets.

:func:`simulate_scaled_mm` reads a :class:`~quant.native.scale_layout.NativeOperands` (packed E2M1 codes,
swizzled E4M3 scales, FP32 tensor scales) and computes the documented semantics of the cuBLASLt
NVFP4 GEMM (``VEC16_UE4M3`` block scales, "1D Block Scaling Factors Layout", and the FP32
``alpha`` epilogue; ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x16`` and
``SwizzleType.SWIZZLE_32_4_4``):

    D[m, n] = round_out( α · Σ_k (q_A[m,k] · s_A[m, k//16]) · (q_B[n,k] · s_B[n, k//16]) ),
    α = s_tensor(A) · s_tensor(B)  (one FP32 multiplication).

It is a test oracle for native kernels, and independent of the emulated GEMM of
:mod:`quant.linear` in everything but the format definitions of :mod:`quant.format`: it decodes
the bytes and unswizzles the scales itself.
"""

from __future__ import annotations

import torch

from ..format import GROUP, decode_e2m1, unpack_codes
from .scale_layout import NativeOperands, unswizzle_scales


def _block_scaled(data: torch.Tensor, flat_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``q · s_block`` (float32, exact: ≤ 2 + 4 significant bits) of one operand."""
    k_padded = 2 * data.shape[1]
    s = unswizzle_scales(flat_scale, rows, k_padded // GROUP)
    if s.dtype != torch.float8_e4m3fn:
        s = s.view(torch.float8_e4m3fn)  # uint8 bytes are read as E4M3
    return decode_e2m1(unpack_codes(data)) * s.float().repeat_interleave(GROUP, dim=-1)


def round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` with a single round-to-nearest-even.

    torch converts float64 to bfloat16/float16 through float32, which rounds twice (it turns
    ``1 + 2^-8 + 2^-40`` into 1 instead of ``1 + 2^-7``). For float64 input narrower targets go
    through float32 rounded to odd (exact, or the neighbour with an odd last bit), which keeps
    the final rounding correct since float32 has at least 2 more significand bits than either.
    """
    if x.dtype != torch.float64 or dtype in (torch.float64, torch.float32):
        return x.to(dtype)
    f = x.float()
    inexact = f.double() != x
    odd = (f.view(torch.int32) & 1).bool()
    inf = torch.full_like(f, float("inf"))
    toward = torch.nextafter(f, torch.where(x > f.double(), inf, -inf))  # the other neighbour
    f = torch.where(inexact & ~odd & torch.isfinite(f), toward, f)
    return f.to(dtype)


def simulate_scaled_mm(
    operands: NativeOperands,
    M: int,
    N: int,
    out_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``M × N`` result of the native NVFP4 GEMM ``A · Bᵀ`` described by ``operands``.

    What it models:

    * decoding: E2M1 codes from the packed bytes (low nibble first), E4M3 block scales from the
      swizzled layout (:func:`~quant.native.scale_layout.unswizzle_scales`), one scale per 16 elements;
      padded K elements (code 0, scale 0) contribute exactly 0;
    * the products ``(q_A s_A)(q_B s_B)``: exact in FP32 (each factor has at most 5 significant
      bits, exponents far inside FP32's normal range), summed over K in ``compute_dtype``:
      FP32 as the hardware's FP32 accumulator, or float64 as a near-exact reference;
    * the epilogue: ``α = s_tensor(A) · s_tensor(B)`` in FP32 (as torch/cuBLAS form ``alpha``),
      times the accumulated sum in ``compute_dtype``, then ONE rounding (nearest-even) to
      ``out_dtype`` (:func:`round_once`).

    What it does not model, and what it assumes:

    * accumulation order: the FP32 sum is torch's CPU matmul order, not the kernel's K-blocked
      tensor-core order; results agree to FP32 summation error, ``≲ K · 2^-24 · Σ_k |a_k||b_k|``
      relative to the scale of the terms, not bitwise;
    * tensor-core internals: no truncation or reduced-precision intermediate sums inside the
      MMA, no ``use_fast_accum`` mode; no bias, no output (D) scale, no FP4 output;
    * subnormals: none flushed to zero, neither E4M3 subnormal scales (decoded exactly) nor
      FP32 subnormal sums or results (IEEE gradual underflow is assumed everywhere); the native
      epilogue's FTZ behaviour is not documented, so this is an assumption;
    * non-finite values: a NaN tensor scale makes every output NaN through ``α``; E4M3 NaN
      scale bytes (0x7F/0xFF) decode to NaN and propagate like any NaN.

    ``M`` and ``N`` must equal the rows of ``operands.a_data`` and ``operands.b_data`` (the
    swizzled scales are padded, so they cannot tell them). Runs on the operands' device.
    """
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")
    if operands.a_data.shape[0] != M or operands.b_data.shape[0] != N:
        raise ValueError(
            f"M × N = {M} × {N} does not match the operands: a_data {tuple(operands.a_data.shape)}, "
            f"b_data {tuple(operands.b_data.shape)}"
        )
    if operands.a_data.shape[1] != operands.b_data.shape[1]:
        raise ValueError(
            f"a_data {tuple(operands.a_data.shape)} and b_data {tuple(operands.b_data.shape)} differ in K"
        )
    a = _block_scaled(operands.a_data, operands.a_scale, M)
    b = _block_scaled(operands.b_data, operands.b_scale, N)
    acc = a.to(compute_dtype) @ b.to(compute_dtype).T
    d = acc * operands.alpha.to(compute_dtype)
    return round_once(d, out_dtype)
