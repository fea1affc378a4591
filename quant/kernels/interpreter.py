"""Workarounds for triton's CPU interpreter (``TRITON_INTERPRET=1``), used by the CPU tests.

Triton's interpreter converts float32 to float8e4nv wrongly for about 2% of values and does not
saturate (upstream issue #8322), multiplies raw bits in a bf16 ``tl.dot`` (#11584), and rounds
``tl.math.fma`` twice (a product, then a sum). The patch routes every float conversion that
touches fp8e4nv or bf16 through torch (whose casts round to nearest even and, with the clamp the
kernels apply first, saturate like the GPU), upcasts bf16 dot operands, and computes float32
FMAs with one rounding (:func:`_fma32`). It only touches private interpreter APIs, hence the
pinned triton version; it is a no-op when the interpreter is not in use.

Two more replacements only save time, computing what the interpreter computes: it re-patched
``triton.language`` on every call of a ``@triton.jit`` helper inside a kernel (``_patch_lang``,
an ``inspect.getmembers`` scan of the language modules: a fifth of the interpreter's time in
the kernel tests), and it rebuilt a table of numpy dtypes on every lookup (``_get_np_dtype``).
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
    _patch_lang_once_per_launch(interp, tl)
    _lookup_np_dtypes_in_one_table(interp, tl)
    _PATCHED = True


def _patch_lang_once_per_launch(interp, tl) -> None:
    """``interp._patch_lang(fn)`` patches the language modules that ``fn``'s globals hold (``tl``,
    ``tl.core``). A launch calls it for its kernel and restores the patch when it ends; every call
    of a jit helper inside the kernel calls it again for the helper (and never restores that),
    scanning the modules anew although the launch has patched them already. Now a helper's call
    patches only modules that the running launch has not patched yet (triton's own helpers see
    ``tl.core``), as the original does, and skips the scan otherwise."""
    original = interp._patch_lang
    patched: set[int] = set()  # ids of the modules patched since the running launch began

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched:
            return interp._LangPatchScope()
        launch = not patched
        scope = original(fn)
        patched.update(langs)
        if launch:
            restore = scope.restore

            def restore_and_forget():
                restore()
                patched.clear()

            scope.restore = restore_and_forget
        return scope

    interp._patch_lang = patch_lang


def _lookup_np_dtypes_in_one_table(interp, tl) -> None:
    """``interp._get_np_dtype``, which builds its table of numpy dtypes on each call, with the
    table's entries kept after their first lookup (by scalar dtype: block types and pointer
    types are not hashable)."""
    original = interp._get_np_dtype
    table: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = original(tt_dtype)
        return found

    interp._get_np_dtype = get_np_dtype


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
