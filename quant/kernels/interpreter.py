"""Workarounds for triton's CPU interpreter (``TRITON_INTERPRET=1``), used by the CPU tests.

Triton's interpreter converts float32 to float8e4nv wrongly for about 2% of values and does not
saturate (upstream issue #8322), multiplies raw bits in a bf16 ``tl.dot`` (#11584), and rounds
``tl.math.fma`` twice (a product, then a sum). The patch routes every float conversion that
touches fp8e4nv or bf16 through torch (whose casts round to nearest even and, with the clamp the
kernels apply first, saturate like the GPU), upcasts bf16 dot operands, and computes float32
FMAs with one rounding (:func:`_fma32`). It only touches private interpreter APIs, hence the
pinned triton version; it is a no-op when the interpreter is not in use.
"""

from __future__ import annotations

import os

import numpy as np
import torch

_PATCHED = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter() -> None:
    """Install the three fixes in ``triton.runtime.interpreter`` (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    torch_of = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16,
                tl.float32: torch.float32, tl.float16: torch.float16}
    np_bits = {8: np.uint8, 16: np.uint16, 32: np.uint32}
    original = interp._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        special = (tl.float8e4nv, tl.bfloat16)
        if (input_dtype in special or output_dtype in special) and input_dtype in torch_of \
                and output_dtype in torch_of:
            arr = np.asarray(input)
            src_int = {8: np.uint8, 16: np.int16, 32: np.int32}[input_dtype.primitive_bitwidth]
            flat = np.ascontiguousarray(arr.reshape(-1)).view(src_int).copy()
            out = torch.from_numpy(flat).view(torch_of[input_dtype]).to(torch_of[output_dtype])
            int_view = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[output_dtype.primitive_bitwidth]
            res = out.contiguous().view(int_view).numpy().view(np_bits[output_dtype.primitive_bitwidth])
            return res.reshape(arr.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    interp._convert_float = convert_float

    builder = interp.InterpreterBuilder
    create_dot = builder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a = interp.TensorHandle(convert_float(a.data, a.dtype, tl.float32, None).view(np.float32), tl.float32)
            b = interp.TensorHandle(convert_float(b.data, b.dtype, tl.float32, None).view(np.float32), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot

    create_fma = builder.create_fma

    def fma(self, x, y, z):
        if z.dtype.scalar != tl.float32:
            return create_fma(self, x, y, z)
        return interp.TensorHandle(_fma32(x.data, y.data, z.data), tl.float32)

    builder.create_fma = fma
    _PATCHED = True


def _fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x·y + z`` in float32 with one rounding, as the GPU's FMA: the product is exact in
    float64, the sum is rounded to odd in float64 (its exact error by TwoSum), and 53 ≥ 24 + 2
    bits make the final rounding to float32 correct."""
    a, b, c = (np.asarray(v, dtype=np.float64) for v in (x, y, z))
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((err != 0) & even & np.isfinite(s),
                     np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)
