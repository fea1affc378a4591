"""Native NVFP4 GEMMs: the packed operands on Blackwell's FP4 tensor cores.

On a GPU of compute capability 10.x or 12.x, the ``native`` backend (:mod:`quant.backend`) runs
each GEMM of a scheme whose two operands are NVFP4 as one call of
``torch.nn.functional.scaled_mm`` with ``torch.float4_e2m1fn_x2`` operands: per operand the
E4M3 block scales (``ScalingType.BlockWise1x16``) in cuBLAS's tiled layout
(``SwizzleType.SWIZZLE_32_4_4``, :mod:`quant.native.scale_layout`) and the FP32 tensor scale
(``ScalingType.TensorWise``), which the GEMM's epilogue applies before its one rounding:

    D = round( s_A · s_B · Σ_k (q_A s_A,blk)(q_B s_B,blk) )

— what the emulated GEMM computes (``quant.linear._product``), up to the order of accumulation.
The operands come from the quantization kernels in packed form (codes, scales, tensor scale):
forward, dgrad and wgrad alike, including the rotated MS-EDEN and SR operands of the backward,
whose rotation is already in the codes. A GEMM with an operand that is not NVFP4 (an ablation
that leaves one side in high precision), or whose compute dtype is not BF16 (a run without BF16
autocast: the probed, documented output), runs emulated.

This package was written against the documented interfaces and checked by simulation only
(:mod:`quant.native.scaled_mm_sim`, which takes exactly the tensors passed here;
``docs/performance.md``, "Native NVFP4 GEMMs"). On each GPU, before the first native GEMM,
:func:`probe` compares one real product with the simulator: where they disagree, ``auto`` keeps
the emulated GEMMs. :func:`simulated` runs the same path with the simulator in place of the
call, on any device.

The package: this module (the GEMM call, the availability check, :func:`probe`,
:func:`simulated`), :mod:`quant.native.scale_layout` (the operands as the call takes them, block
scales swizzled) and :mod:`quant.native.scaled_mm_sim` (the simulator). It is imported on first
use: by :mod:`quant.backend` when it asks whether GEMMs run natively, by :mod:`quant.linear` for a
native GEMM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..format import PackedNVFP4
from .scale_layout import NativeOperands, native_operands
from .scaled_mm_sim import simulate_scaled_mm

NATIVE_CAPABILITIES = (10, 12)
"""Compute-capability majors with NVFP4 tensor cores: 10 (B200, GB200, B300) and 12 (RTX 50xx,
RTX PRO 6000 Blackwell)."""

GemmCall = Callable[[NativeOperands, int, int, torch.dtype], torch.Tensor]

_simulator: GemmCall | None = None
_calls: list[tuple[int, int, int]] | None = None
_reasons: dict[int, str | None] = {}


def torch_supports_nvfp4() -> bool:
    """Whether this torch has the NVFP4 interface used here (``float4_e2m1fn_x2`` and
    ``F.scaled_mm`` with ``BlockWise1x16`` scaling)."""
    scaling = getattr(F, "ScalingType", None)
    return (hasattr(torch, "float4_e2m1fn_x2") and hasattr(F, "scaled_mm")
            and scaling is not None and hasattr(scaling, "BlockWise1x16"))


def unavailable_reason(device: torch.device) -> str | None:
    """Why native NVFP4 GEMMs cannot run on ``device`` (None: they can); found once per GPU
    (it is asked before every GEMM)."""
    if _simulator is not None:
        return None
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not a CUDA GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _reasons:
        _reasons[index] = _gpu_reason(torch.device("cuda", index))
    return _reasons[index]


def _gpu_reason(device: torch.device) -> str | None:
    """:func:`unavailable_reason` of one GPU: its compute capability, torch's interface, then
    :func:`probe`."""
    major, minor = torch.cuda.get_device_capability(device)
    if major not in NATIVE_CAPABILITIES:
        name = torch.cuda.get_device_name(device)
        return (f"{name} has compute capability {major}.{minor}; NVFP4 tensor cores need "
                f"{' or '.join(f'{c}.x' for c in NATIVE_CAPABILITIES)} (Blackwell)")
    if not torch_supports_nvfp4():
        return (f"torch {torch.__version__} lacks torch.float4_e2m1fn_x2 or "
                "torch.nn.functional.scaled_mm with ScalingType.BlockWise1x16")
    return probe(device)


@torch.compiler.disable
def probe(device: torch.device, call: GemmCall | None = None) -> str | None:
    """Run one small native GEMM on ``device`` (``call``: default the real one) and compare it
    with the simulator on the same operands: None when they agree to one BF16 ulp, else why not
    (the call failed, or its result departs from the documented semantics, e.g. a scale layout
    this code does not match). It runs once per GPU, eagerly even under ``torch.compile``; before
    capturing CUDA graphs, call :func:`quant.backend.describe` (train.py does, at startup) so that
    it has run. A 208×144 by 144×144 product: the scale rows need padding to 128
    and K to 64, as in a layer whose dimensions are multiples of 16, not of 128."""
    from ..quantizers import quantize_rtn

    m, n, k = 208, 144, 144
    g = torch.Generator().manual_seed(0)
    a, b = (quantize_rtn(torch.randn(rows, k, generator=g) * 4).pack() for rows in (m, n))
    a, b = (PackedNVFP4(p.data.to(device), p.scales.to(device), p.tensor_scale.to(device)) for p in (a, b))
    ops = native_operands(a, b)
    want = simulate_scaled_mm(ops, m, n, torch.bfloat16)
    try:
        got = (call or scaled_mm)(ops, m, n, torch.bfloat16)
    except (RuntimeError, TypeError, ValueError) as err:
        return f"torch's NVFP4 scaled_mm failed on it ({type(err).__name__}: {str(err)[:300]})"
    worst = bf16_ulps(got, want) if got.shape == want.shape else float("inf")
    if not worst <= 1.0:
        return (f"torch's NVFP4 scaled_mm departs from the documented semantics on it by {worst:.3g} "
                "BF16 ulps on a test product (python -m scripts.check_native shows where)")
    return None


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got − want|`` in BF16 ulps of ``want`` (the spacing at ``|want|``, at least
    BF16's smallest normal's); inf when either holds a non-finite value."""
    got, want = got.float(), want.float()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return float(((got - want).abs() / ulp).max())


def scaled_mm(ops: NativeOperands, m: int, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``A · Bᵀ`` (``m × n``) through ``torch.nn.functional.scaled_mm`` with NVFP4 operands:
    A as ``m × K/2`` and B as its transposed ``K/2 × n`` view of ``float4_e2m1fn_x2``, each with
    ``[block scales, tensor scale]`` under ``[BlockWise1x16, TensorWise]`` and swizzles
    ``[SWIZZLE_32_4_4, NO_SWIZZLE]``."""
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    fp4 = torch.float4_e2m1fn_x2
    return F.scaled_mm(
        ops.a_data.view(fp4), ops.b_data.view(fp4).t(),
        scale_a=[ops.a_scale.view(torch.float8_e4m3fn), ops.a_tensor_scale.reshape(1)],
        scale_recipe_a=recipe,
        scale_b=[ops.b_scale.view(torch.float8_e4m3fn), ops.b_tensor_scale.reshape(1)],
        scale_recipe_b=recipe,
        swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype,
    )


def gemm(a: PackedNVFP4, b: PackedNVFP4, dtype: torch.dtype,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A · Bᵀ`` of two packed operands grouped along their shared last dim, rounded once to
    ``dtype`` by the native call (or the simulator, under :func:`simulated`), returned in
    ``out_dtype`` (default ``dtype``)."""
    a, b = _e4m3(a), _e4m3(b)
    ops = native_operands(a, b)
    m, n = a.data.shape[0], b.data.shape[0]
    if _calls is not None:
        _calls.append((m, n, ops.k))
    call = _simulator or scaled_mm
    return call(ops, m, n, dtype).to(out_dtype or dtype)


def _e4m3(p: PackedNVFP4) -> PackedNVFP4:
    """``p`` with its scales viewed as ``float8_e4m3fn`` (the kernels write them as bytes)."""
    if p.scales.dtype == torch.float8_e4m3fn:
        return p
    return PackedNVFP4(p.data, p.scales.view(torch.float8_e4m3fn), p.tensor_scale, p.dim, p.tile)


@contextmanager
def simulated(compute_dtype: torch.dtype = torch.float32) -> Iterator[list[tuple[int, int, int]]]:
    """Run the native backend's GEMMs through :func:`quant.native.scaled_mm_sim.simulate_scaled_mm`
    (on any device, e.g. a CPU or a Hopper GPU) instead of ``F.scaled_mm``. Yields the list of
    the GEMMs run, ``(M, N, K)`` each, in order."""
    global _simulator, _calls
    old = (_simulator, _calls)
    calls: list[tuple[int, int, int]] = []

    def simulate(ops: NativeOperands, m: int, n: int, out_dtype: torch.dtype) -> torch.Tensor:
        return simulate_scaled_mm(ops, m, n, out_dtype, compute_dtype)

    _simulator, _calls = simulate, calls
    try:
        yield calls
    finally:
        _simulator, _calls = old
