"""Launchers of the Triton quantizers, registered as ``torch.library`` custom ops (``nvfp4::``).

Each op has a fake (meta) implementation, so the ops are opaque to ``torch.compile`` and work
under it. All ops quantize a *logical* 2-D operand ``A`` along its last dim (the reduction dim):
``A = x`` or, with ``transpose=True``, ``A = xᵀ`` (read across memory rows: by row-wise slices
joined in registers for the quantizers of :func:`whole_groups`, or made contiguous by one
transpose pass first, or transposed on chip by the quantization kernel, as the
:class:`~quant.kernels.tuning.KernelTuning` in use says). Outputs, in the layout of ``A``
(``M × K``):

* ``values``: BF16 ``q · s_block`` (exact), the GEMM-ready operand; with ``posthoc`` (MS-EDEN's
  post hoc range alignment, whose tensor scale is a power of two) ``q · s_block · s_tensor``,
  the scale folded in (exact down to BF16's normal range, 2^-126);
* ``codes``: uint8 ``M × K/2``, element ``2i`` in the low nibble (``NVFP4Tensor.pack`` layout);
* ``scales``: ``float8_e4m3fn`` block scales, ``M × K/16`` (``M/16 × K/16`` for 16×16 tiles);
* ``tensor_scale``: FP32 0-dim; ``amax``: FP32 0-dim, the current ``max |A|`` (after rotation),
  which delayed-amax callers store for the next call (with ``posthoc``, MS-EDEN's post hoc range
  alignment: the largest corrected scale instead).

``amax`` (optional input) is the delayed amax of the previous call: it is used when positive and
finite and the current amax is finite, else the current amax is (as ``quant.linear._amax`` and
``quant.quantizers.amax_of``: a NaN or ±inf in ``A`` makes the whole result NaN, the non-finite
rule of :mod:`quant.quantizers`). Stochastic quantizers take either explicit
``uniforms`` (SR: shape of ``A``; MS-EDEN: ``M × K/16``) or a ``seed`` (int64 tensor of one
element, the Philox key) and a ``stream`` number (Philox draws, see
:mod:`quant.kernels.triton_kernels`). :func:`philox_uniforms` returns exactly the draws the
seeded path uses, and :func:`philox_signs` Hadamard signs from the same generator.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..format import E2M1_MAX, E4M3_MAX, GROUP
from ..quantizers import EDEN_CORRECTIONS, EDEN_SCALE_MAX, EDEN_TARGET, FOUR_OVER_SIX_SCALE_MAX, SR_TARGET
from . import triton_kernels as K
from .interpreter import interpreting, patch_interpreter
from .tuning import KernelTuning, get_tuning

_INTERPRET = interpreting()
"""Whether the kernels were decorated for triton's CPU interpreter (decided at import)."""
if _INTERPRET:
    patch_interpreter()

# Source kinds of an operand.
SRC_DENSE, SRC_PACKED, SRC_PACKED_2D = 0, 1, 2
# quant_kernel's MODE per quantizer name.
MODES = {"rtn": K.MODE_RTN, "rtn_2d": K.MODE_RTN, "sr": K.MODE_SR, "ms_eden": K.MODE_EDEN}


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in Python (``triton.cdiv`` is a jit function: each host call of it goes
    through triton's launcher machinery)."""
    return -(-a // b)


def _grid(M: int, Kd: int, bm: int, bk: int, tiles: int) -> tuple[int, ...]:
    """One program per ``bm × bk`` tile (2-D), or per ``tiles`` consecutive tiles (1-D)."""
    grid = (_cdiv(M, bm), _cdiv(Kd, bk))
    return grid if tiles == 1 else (_cdiv(grid[0] * grid[1], tiles),)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _align_programs(device: torch.device, tuning: KernelTuning) -> int:
    """Programs of MS-EDEN's post hoc align pass when it writes scales: ``align_programs_per_sm``
    per SM of ``device`` (one in the interpreter); they stride over the pass's tiles."""
    if _INTERPRET:
        return 1
    return tuning.align_programs_per_sm * _sm_count(device)


def whole_groups(mode: str, rot: int, four_over_six: bool) -> bool:
    """Whether ``quant_kernel`` holds each 16-group in one thread's registers (its ``GROUPS``):
    the compute-bound quantizers (SR, 4/6, the rotations, MS-EDEN), whose per-group work then
    needs no exchange between lanes; such an operand read across memory rows is loaded by
    slices joined in registers (``_load_groups_cols``), with no transpose. Plain RTN is bound
    by memory transactions, which contiguous 8-element vectors across lanes keep fewer (H200,
    16384×4096 rows, 2026-11: 161.7 µs against 178.8 with two half-group loads per thread), and
    16×16 tiles span 16 rows."""
    return (rot > 0 or four_over_six or mode != "rtn") and mode != "rtn_2d"


def layout_of(rot: int, cols: bool, groups: bool = False, mode: str = "rtn") -> str:
    """The layout (:data:`quant.kernels.tuning.LAYOUTS`) of an operand rotated in chunks of
    ``rot`` (0: none), read along its memory rows or across them (``cols``), with whole
    16-groups per thread (``groups``, :func:`whole_groups`), under the quantizer ``mode``
    (``rtn_2d``: 16×16 scale tiles; ``ms_eden``: its own tiles for rotated rows and sliced
    columns)."""
    if cols:
        if groups:
            return "cols_eden" if mode == "ms_eden" else "cols_groups"
        return "cols" if rot <= GROUP else "cols_wide"
    if mode == "rtn_2d":
        return "rows_2d"
    if rot >= 32:
        return "rows_eden" if mode == "ms_eden" else "rows_wide"
    return "rows"


def _config(layout: str = "rows", rot: int = 0,
            tuning: KernelTuning | None = None) -> tuple[int, int, int]:
    """(BM, BK, num_warps) of a layout for an operand rotated in chunks of ``rot`` (0: none):
    the tile of ``tuning`` (default: the tuning in use), BK raised to ``rot``."""
    bm, bk, nw = (tuning or get_tuning()).tiles[layout]
    return bm, max(bk, rot), nw


def _tiles_per_program(layout: str, tuning: KernelTuning | None = None) -> int:
    """Tiles per program of a layout under ``tuning`` (default: the tuning in use)."""
    return (tuning or get_tuning()).tiles_per_program[layout]


def _f32(v: float) -> float:
    """``v`` rounded to FP32 (as torch rounds a Python float divisor of an FP32 tensor)."""
    return float(np.float32(v))


@functools.cache
def _targets(mode: str, four_over_six: bool) -> tuple[float, float]:
    """(tensor target, block target) of a quantizer, as in :mod:`quant.quantizers`."""
    scale_max = FOUR_OVER_SIX_SCALE_MAX if four_over_six else E4M3_MAX
    if mode in ("rtn", "rtn_2d"):
        return _f32(E2M1_MAX * scale_max), _f32(E2M1_MAX)
    if mode == "sr":
        return _f32(SR_TARGET * scale_max), _f32(SR_TARGET)
    if mode == "ms_eden":
        return _f32(EDEN_SCALE_MAX * EDEN_TARGET), _f32(EDEN_TARGET)
    raise ValueError(f"unknown kernel quantizer {mode!r}")


def _operand(x: Tensor, src: int, transpose: bool):
    """(M, K, stride_m, stride_k, P_C, PT) of the logical operand."""
    if x.dim() != 2:
        raise ValueError(f"the NVFP4 kernels take 2-D operands, got shape {tuple(x.shape)}")
    if src == SRC_DENSE:
        a = x.t() if transpose else x
        M, Kd = a.shape
        if M and Kd and (M - 1) * a.stride(0) + (Kd - 1) * a.stride(1) >= 2**31:
            raise ValueError(f"the NVFP4 kernels index with 32-bit offsets; operand of shape {tuple(a.shape)} "
                             f"and strides {a.stride()} spans 2^31 elements or more: pass a contiguous copy")
        return M, Kd, a.stride(0), a.stride(1), 0, False
    if not x.is_contiguous():
        raise ValueError("packed NVFP4 data must be contiguous")
    R, C = x.shape[0], x.shape[1] * 2
    M, Kd = (C, R) if transpose else (R, C)
    return M, Kd, 0, 0, C, transpose


def _rotation(signs: Optional[Tensor]) -> tuple[int, float, Optional[Tensor]]:
    """Rotation size, its FP32 ``1/√h`` and the signs as the kernels read them (int8: a thread
    then loads 16 at once, which gives the rotation its register layout; see ``_load_tile``)."""
    if signs is None:
        return 0, 1.0, None
    h = signs.numel()
    return h, _inv_sqrt(h), signs.to(torch.int8).contiguous()


@functools.cache
def _inv_sqrt(h: int) -> float:
    """FP32 ``1/√h``."""
    return _f32(1.0 / math.sqrt(h))


def tile_meta(bm: int, bk: int, rot: int, tile2d: bool = False) -> dict:
    """``quant_kernel``'s tile meta-parameters ``[BM, CH, R, 16]`` for a ``BM × BK`` tile (BK a
    multiple of the rotation size ``rot``; 16×16 scale tiles take 16 rows)."""
    r = rot // GROUP if rot else bk // GROUP
    return dict(BM=GROUP if tile2d else bm, CH=bk // (r * GROUP), R=r, LOG_R=int(math.log2(r)) if rot else 0)


def _tiling(layout: str, rot: int, tuning: KernelTuning,
            tile2d: bool = False) -> tuple[dict, int, int, int]:
    """Tile meta-parameters (:func:`tile_meta`), BK, num_warps and tiles per program of an
    operand of ``layout`` (:func:`layout_of`) rotated in chunks of ``rot``, under ``tuning``."""
    bm, bk, nw = _config(layout, rot, tuning)
    return tile_meta(bm, bk, rot, tile2d), bk, nw, _tiles_per_program(layout, tuning)


def _is_cols(src: int, stride_k: int, pt: bool) -> bool:
    """Whether the logical operand is read across memory rows (a transposed view)."""
    return pt if src != SRC_DENSE else stride_k != 1


_COMPILED: dict = {}
"""Compiled kernels by :func:`_launch_key`, each with its constexpr arguments in parameter order:
after a launch through triton's ``JITFunction.run`` compiled (or found) a kernel, later launches
with the same key call its launcher directly. ``JITFunction.run`` spent about 66 µs of host
time per launch on the H200's host (binding and specializing the arguments, the cache key, the
launch metadata; cProfile of a compiled 100m quartet2 step, 2026-11), and a compiled step
without a CUDA graph makes about 480 launches."""


def _launch_key(kernel, num_warps: int, meta: dict, args: tuple) -> tuple:
    """What decides which compiled kernel a launch uses, refined: the device, the options and
    constexprs, and per argument its dtype and 16-byte alignment (a tensor: what triton
    specializes a pointer on) or its value (a scalar: finer than triton's specialization of
    integers on their width, divisibility by 16 and being 1)."""
    return (kernel, torch.cuda.current_device(), num_warps, tuple(meta.items()),
            tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else a for a in args))


@functools.cache
def _runtime_names(kernel) -> tuple[str, ...]:
    """The names of ``kernel``'s run-time parameters (those not annotated ``tl.constexpr``), in
    order (the same for a compiled kernel and the interpreter's)."""
    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if "constexpr" not in str(p.annotation))


def _launch(kernel, grid, args: Mapping[str, object], *, num_warps: int, **meta) -> None:
    """Launch ``kernel`` on ``grid`` with its run-time parameters ``args`` by name and its
    compile-time ones ``meta``."""
    names = _runtime_names(kernel)
    values = tuple(args.get(n) for n in names)
    hit = None if _INTERPRET else _COMPILED.get(key := _launch_key(kernel, num_warps, meta, values))
    if hit is None:
        if set(args) != set(names):
            raise TypeError(f"{kernel.fn.__name__} takes the run-time arguments {names}, "
                            f"got {tuple(args)}")
        if _INTERPRET:
            kernel[grid](*values, **meta)
            return
        compiled = kernel[grid](*values, num_warps=num_warps, enable_fp_fusion=False, **meta)
        rest = kernel.arg_names[len(values):]
        if set(rest) == set(meta):  # every parameter was passed (none left to its default)
            _COMPILED[key] = (compiled, tuple(meta[n] for n in rest))
        return
    compiled, constexprs = hit
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*values, *constexprs)  # triton's own runner


def _check(M: int, Kd: int, mode: str, rot: int) -> None:
    if Kd % GROUP:
        raise ValueError(f"the reduction dim ({Kd}) must be divisible by {GROUP}")
    if mode == "rtn_2d" and M % GROUP:
        raise ValueError(f"16×16 quantization needs both dims divisible by 16, got {M}×{Kd}")
    if rot and Kd % rot:
        raise ValueError(f"the reduction dim ({Kd}) must be divisible by the rotation size {rot}")
    if M * Kd >= 2**31:
        raise ValueError("operands of 2^31 elements or more are not supported by the kernels")


def _whole_tiles(M: int, Kd: int, bm: int, bk: int) -> bool:
    """Whether ``M × Kd`` is covered by whole ``bm × bk`` tiles: the kernels then need no masks."""
    return M % bm == 0 and Kd % bk == 0


def _amax_impl(x, x_scales, src, transpose, in_scale, signs) -> Tensor:
    """``max |A|`` (FP32 0-dim) of the logical operand, rotated by ``signs`` when given (SPEC
    §2, the tensor scale's amax); :func:`amax_kernel` with the row or sliced column tiles."""
    M, Kd, sm, sk, pc, pt = _operand(x, src, transpose)
    rot, inv, signs = _rotation(signs)
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    if M == 0 or Kd == 0:
        return out
    cols = _is_cols(src, sk, pt)  # a column operand is read by slices (whole_groups)
    meta, bk, nw, tiles = _tiling(layout_of(rot, cols, groups=cols), rot, get_tuning())
    _launch(K.amax_kernel, _grid(M, Kd, meta["BM"], bk, tiles), dict(
        x_ptr=x, xs_ptr=x_scales if x_scales is not None else x,
        scale_ptr=in_scale if in_scale is not None else out,
        signs_ptr=signs if signs is not None else out, amax_ptr=out,
        M=M, K=Kd, stride_m=sm, stride_k=sk, P_C=pc),
        SRC=src, COLS=cols, HAS_SCALE=in_scale is not None, ROT=rot, INV_SQRT=inv,
        EVEN=_whole_tiles(M, Kd, meta["BM"], bk), GROUPS=cols, TILES=tiles, num_warps=nw, **meta)
    return out


def _out_shapes(M: int, Kd: int, mode: str, values: bool, pack: bool):
    sc = (M // GROUP, Kd // GROUP) if mode == "rtn_2d" else (M, Kd // GROUP)
    return ((M, Kd) if values else (0,)), ((M, Kd // 2) if pack else (0,)), (sc if pack else (0,))


_SOURCE_KINDS = ("dense", "packed", "packed_2d")
"""Source kinds by ``SRC_*`` number, as :attr:`KernelTuning.sliced_sources` names them."""


def _transposes_first(src: int, cols: bool, groups: bool, mode: str,
                      tuning: KernelTuning) -> bool:
    """Whether an operand read across memory rows is made contiguous by ``transpose_kernel``
    before quantizing (:attr:`KernelTuning.transpose_cols`), rather than loaded by slices (the
    whole-group quantizers of ``mode`` on a source kind of :attr:`KernelTuning.sliced_sources`)
    or transposed on chip. ``mode`` is part of the decision for the whole-group test only."""
    sliced = groups and _SOURCE_KINDS[src] in tuning.sliced_sources
    return cols and tuning.transpose_cols and not sliced


def _rows_operand(x, x_scales, src, transpose, groups, mode, tuning: KernelTuning):
    """``(x, x_scales, src, transpose)`` to quantize, its :func:`_operand` geometry and whether it
    is read across memory rows (:func:`_is_cols`): a column operand that
    :func:`_transposes_first` becomes its contiguous transpose (packed sources as their exact
    BF16 values), read along rows."""
    geometry = _operand(x, src, transpose)
    M, Kd, sm, sk, pc, pt = geometry
    cols = _is_cols(src, sk, pt)
    if not _transposes_first(src, cols, groups, mode, tuning):
        return x, x_scales, src, transpose, geometry, cols
    out = torch.empty((M, Kd), dtype=x.dtype if src == SRC_DENSE else torch.bfloat16, device=x.device)
    if M and Kd:
        bm, bk, nw = tuning.transpose_tile
        _launch(K.transpose_kernel, (_cdiv(M, bm), _cdiv(Kd, bk)), dict(
            x_ptr=x, xs_ptr=x_scales if x_scales is not None else x, out_ptr=out,
            M=M, K=Kd, stride_m=sm, stride_k=sk, P_C=pc), SRC=src, BM=bm, BK=bk, num_warps=nw)
    return out, None, SRC_DENSE, False, _operand(out, SRC_DENSE, False), False


def _prefetches(src: int, cols: bool, groups: bool, tiles: int, mode: str,
                four_over_six: bool) -> bool:
    """Whether ``quant_kernel`` loads each tile of a program's loop while quantizing the one
    before (its ``PREFETCH``): for dense operands read along rows by whole groups, under RTN with
    4/6 only (quartet2's and four_over_six's X and W). H200, triton 3.6, 16384×4096 rows,
    2026-11, µs: RTN+4/6 212.5 with prefetching against 198.7 without; the other quantizers
    take more registers with it and are slower: post hoc MS-EDEN 157.7 against 149.8 (96
    registers instead of 72), RHT32+SR 205.8 against 203.5 (212 instead of 168), RHT16+RTN
    142.0 against 136.0, RHT16+SR 211.2 against 206.8, SR 184.4 against 182.1."""
    return (tiles > 1 and src == SRC_DENSE and groups and not cols and mode == "rtn"
            and four_over_six)


def _shares_draws(tiles: int, bk: int, mode: str, rand: int, Kd: int) -> bool:
    """Whether a program of ``quant_kernel`` draws MS-EDEN's group uniforms once for all its
    tiles (its ``SHARED_U``; ``triton_kernels._eden_draw``): four 128-column tiles of one block
    of 32 groups, which a 1-D grid of four-tile programs gives when K is a multiple of 512 (a
    row then holds whole programs). Seeded draws only."""
    return tiles == 4 and bk == 128 and mode == "ms_eden" and rand == 1 and Kd % 512 == 0


@dataclass(frozen=True)
class AlignPlan:
    """The launch of ``eden_align_kernel``, MS-EDEN's post hoc align pass (SPEC §2, MS-EDEN
    steps 5'–6'): with the packed form's scales, ``tiles`` tiles of groups that a 1-D grid of at
    most :func:`_align_programs` programs strides over; without, one program per
    ``align_minima[0]`` first-pass programs (``tiles`` programs)."""

    tiles: int
    strided: bool
    num_warps: int
    constexprs: Mapping[str, object]


@dataclass(frozen=True)
class QuantPlan:
    """The launch of one quantization by ``quant_kernel``, decided once per operand geometry,
    quantizer and :class:`KernelTuning` (:func:`plan_quantize`, cached): the grid, the warps,
    the kernel's compile-time parameters (``constexprs``, in call order), the first-pass
    programs ``n_prog`` and their tiles per program, and the post hoc align pass (``align``)."""

    grid: tuple[int, ...]
    num_warps: int
    constexprs: Mapping[str, object]
    n_prog: int
    tiles: int
    align: Optional[AlignPlan]


@functools.lru_cache(maxsize=4096)
def plan_quantize(M: int, Kd: int, src: int, cols: bool, rot: int, mode: str,
                  four_over_six: bool, rand: int, has_scale: bool, values: bool, pack: bool,
                  posthoc: bool, energy: bool, tuning: KernelTuning) -> QuantPlan:
    """The :class:`QuantPlan` of an ``M × Kd`` logical operand of source kind ``src``, read
    across memory rows (``cols``) or along them, rotated in chunks of ``rot`` (0: none), under
    the quantizer ``mode`` (``four_over_six``; draws explicit ``rand=0`` or Philox ``1``; an
    FP32 input scale ``has_scale``), writing the BF16 values, the packed form, with post hoc
    range alignment, with MS-EDEN's energy-weighted step 4 (``energy``, ``quant_kernel``'s
    ENERGY), under ``tuning``."""
    groups = whole_groups(mode, rot, four_over_six)
    tile2d = mode == "rtn_2d"
    meta, bk, nw, tiles = _tiling(layout_of(rot, cols, groups, mode), rot, tuning, tile2d)
    grid = _grid(M, Kd, meta["BM"], bk, tiles)
    t_tensor, t_block = _targets(mode, four_over_six)
    constexprs = dict(
        T_TENSOR=t_tensor, T_BLOCK=t_block, SRC=src, COLS=cols, HAS_SCALE=has_scale, ROT=rot,
        INV_SQRT=_inv_sqrt(rot) if rot else 1.0, MODE=MODES[mode], FOUR_SIX=four_over_six,
        TILE2D=tile2d, RAND=rand, WRITE_VALUES=values, PACK=pack, POSTHOC=posthoc,
        ENERGY=energy, EVEN=_whole_tiles(M, Kd, meta["BM"], bk), GROUPS=groups, TILES=tiles,
        PREFETCH=_prefetches(src, cols, groups, tiles, mode, four_over_six),
        SHARED_U=_shares_draws(tiles, bk, mode, rand, Kd), **meta)
    n_prog = math.prod(grid)
    align = None
    if posthoc:
        bm, g, align_warps = tuning.align_tile
        per_program, minima_warps = tuning.align_minima
        if pack:  # a grid that strides over [bm, g] tiles of groups
            align_tiles, strided = _cdiv(M, bm) * _cdiv(Kd // GROUP, g), True
        else:  # a program per `per_program` first-pass programs
            align_tiles, strided, align_warps = _cdiv(n_prog, per_program), False, minima_warps
        align = AlignPlan(align_tiles, strided, align_warps, MappingProxyType(dict(
            RAND=rand, SCALES=pack, FIX_VALUES=values, EVEN=_whole_tiles(M, Kd, bm, g * GROUP),
            BM=bm, G=g, V=per_program, Q_BM=meta["BM"], Q_G=bk // GROUP,
            Q_T=1 << (tiles - 1).bit_length())))
    return QuantPlan(grid, nw, MappingProxyType(constexprs), n_prog, tiles, align)


@dataclass(frozen=True)
class QuantizeCall:
    """One quantization, as :func:`quantize_operand` takes it (see there and the module
    docstring): the operand (``x``, with ``x_scales`` for packed sources of kind ``src``, read
    as ``xᵀ`` with ``transpose``, times ``in_scale``, rotated by ``signs``), the quantizer
    (``mode``, ``four_over_six``, ``posthoc``), its draws (``uniforms``, or ``seed`` and
    ``stream``), the amax (``prev_amax`` delayed, ``amax`` known) and the outputs wanted
    (``values``, ``pack``); ``eden_correction``: MS-EDEN's step 4, ``"chunk_scaled"`` (SPEC
    §2) or ``"energy"`` (``quant.quantizers.quantize_ms_eden``'s ``correction``)."""

    x: Tensor
    mode: str
    x_scales: Optional[Tensor] = None
    src: int = SRC_DENSE
    transpose: bool = False
    in_scale: Optional[Tensor] = None
    signs: Optional[Tensor] = None
    four_over_six: bool = False
    posthoc: bool = False
    uniforms: Optional[Tensor] = None
    seed: Optional[Tensor] = None
    stream: int = 0
    prev_amax: Optional[Tensor] = None
    amax: Optional[Tensor] = None
    values: bool = True
    pack: bool = True
    eden_correction: str = "chunk_scaled"


def quantize(call: QuantizeCall) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Run ``call`` on the kernels (the body of :func:`quantize_operand`, which the named ops
    and the eager path of ``quant.kernels.dispatch`` use): checks the arguments, runs the amax
    pass unless ``amax`` or ``posthoc`` makes it unneeded, and launches the :class:`QuantPlan`
    of the operand (:func:`_launch_quantize`). Returns ``(values, codes, scales, tensor_scale,
    amax)``."""
    tuning = get_tuning()
    mode, posthoc, four_over_six = call.mode, call.posthoc, call.four_over_six
    rot, _, signs = _rotation(call.signs)
    groups = whole_groups(mode, rot, four_over_six)
    x, x_scales, src, transpose, (M, Kd, sm, sk, pc, _), cols = _rows_operand(
        call.x, call.x_scales, call.src, call.transpose, groups, mode, tuning)
    _check(M, Kd, mode, rot)
    prev_amax, amax, in_scale = call.prev_amax, call.amax, call.in_scale
    if posthoc and (mode != "ms_eden" or prev_amax is not None or amax is not None):
        raise ValueError("post hoc range alignment is MS-EDEN's, and takes no (delayed) amax")
    energy = call.eden_correction == "energy"
    if call.eden_correction not in EDEN_CORRECTIONS or (energy and mode != "ms_eden"):
        raise ValueError(f"eden_correction is MS-EDEN's step 4, chunk_scaled or energy: got "
                         f"{call.eden_correction!r} for {mode}")
    dev = x.device
    if posthoc:  # the first pass sends max(c) to the align pass
        amax = torch.zeros(1, dtype=torch.float32, device=dev)
        current = amax[0]
    else:
        current = (amax.to(torch.float32, copy=True) if amax is not None  # an output: no alias
                   else _amax_impl(x, x_scales, src, transpose, in_scale, signs))
        if prev_amax is not None:  # as quant.linear._amax and quant.quantizers.amax_of
            prev = prev_amax.float()
            amax = torch.where((prev > 0) & (torch.maximum(prev, current) < math.inf), prev, current)
        else:
            amax = current
    vshape, cshape, sshape = _out_shapes(M, Kd, mode, call.values, call.pack)
    val = torch.empty(vshape, dtype=torch.bfloat16, device=dev)
    codes = torch.empty(cshape, dtype=torch.uint8, device=dev)
    scales = torch.empty(sshape, dtype=torch.uint8, device=dev)
    # The quantization (or align) kernel writes the tensor scale; an empty operand keeps 1. (One
    # fill kernel fewer per call: eager steps are bound by host launches.)
    st = (torch.empty if M and Kd else torch.ones)((), dtype=torch.float32, device=dev)
    uniforms, seed = call.uniforms, call.seed
    if mode in ("sr", "ms_eden") and (uniforms is None) == (seed is None):
        raise ValueError(f"{mode} needs exactly one of uniforms or seed")
    if uniforms is not None:
        expect = (M, Kd) if mode == "sr" else (M, Kd // GROUP)
        if tuple(uniforms.shape) != expect:
            raise ValueError(f"{mode} uniforms must have shape {expect}, got {tuple(uniforms.shape)}")
        uniforms = uniforms.float().contiguous()
    if mode == "ms_eden" and rot == 0:
        raise ValueError("MS-EDEN needs a rotation (signs)")
    if M and Kd:
        plan = plan_quantize(M, Kd, src, cols, rot, mode, four_over_six,
                             0 if uniforms is not None else 1, in_scale is not None, call.values,
                             call.pack, posthoc, energy, tuning)
        dummy = st  # the pointer of an absent operand (never read)
        _launch_quantize(plan, dict(
            x_ptr=x, xs_ptr=x_scales if x_scales is not None else x,
            scale_ptr=in_scale if in_scale is not None else dummy,
            signs_ptr=signs if signs is not None else dummy, amax_ptr=amax,
            u_ptr=uniforms if uniforms is not None else dummy,
            seed_ptr=seed if seed is not None else dummy,
            val_ptr=val, code_ptr=codes, sc_ptr=scales, st_ptr=st,
            M=M, K=Kd, stride_m=sm, stride_k=sk, P_C=pc, stream=call.stream), tuning)
    return val, codes, scales.view(torch.float8_e4m3fn), st, current


def _launch_quantize(plan: QuantPlan, args: dict, tuning: KernelTuning) -> None:
    """Launch ``quant_kernel`` and, with post hoc alignment, ``eden_align_kernel`` as ``plan``
    says, with ``quant_kernel``'s run-time arguments ``args`` by name, less ``c_ptr`` (the post
    hoc scratch, made here)."""
    M, Kd = args["M"], args["K"]
    # post hoc: the corrected scales, their roundings and each program's least positive one
    # (quant_kernel's POSTHOC)
    c = torch.empty(2 * M * (Kd // GROUP) + plan.n_prog if plan.align is not None else 0,
                    dtype=torch.float32, device=args["x_ptr"].device)
    _launch(K.quant_kernel, plan.grid, dict(args, c_ptr=c), num_warps=plan.num_warps,
            **plan.constexprs)
    a = plan.align
    if a is not None:
        grid = min(a.tiles, _align_programs(c.device, tuning)) if a.strided else a.tiles
        _launch(K.eden_align_kernel, (grid,), dict(
            c_ptr=c, cmax_ptr=args["amax_ptr"], u_ptr=args["u_ptr"], seed_ptr=args["seed_ptr"],
            val_ptr=args["val_ptr"], sc_ptr=args["sc_ptr"], st_ptr=args["st_ptr"], M=M, K=Kd,
            stream=args["stream"], n_prog=plan.n_prog, q_tiles=plan.tiles),
            num_warps=a.num_warps, **a.constexprs)


def quantize_fake(call: QuantizeCall) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The outputs of :func:`quantize` as ``torch.compile`` traces them (shapes, no kernels)."""
    x = call.x
    M, Kd, *_ = _operand(x, call.src, call.transpose)
    vshape, cshape, sshape = _out_shapes(M, Kd, call.mode, call.values, call.pack)
    return (x.new_empty(vshape, dtype=torch.bfloat16), x.new_empty(cshape, dtype=torch.uint8),
            x.new_empty(sshape, dtype=torch.float8_e4m3fn),
            x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32))


_LIB = torch.library.Library("nvfp4", "DEF")
"""The ``nvfp4::`` operator library (kept alive for as long as the module: the ops live in it)."""


def _op(fn=None, *, tags: tuple = ()):
    """Register ``fn`` as the operator ``nvfp4::<its name>`` (with ``tags``) and return the
    operator; ``@_op(tags=...)`` as a decorator with arguments.

    The schema comes from ``fn``'s annotations, as ``torch.library.custom_op`` infers it, and
    ``fn`` is the kernel for every device (``CompositeExplicitAutograd``). Unlike ``custom_op``,
    no Python autograd layer wraps the call: the quantizers take no gradients (the autograd
    Function of ``quant.linear`` calls them with grad mode off), and that layer cost about 9 µs
    of host time per call (28.5 against 20.0 µs for a post hoc MS-EDEN call with its launches
    stubbed, on a development CPU), which compiled steps without a CUDA graph pay per call."""
    if fn is None:
        return functools.partial(_op, tags=tags)
    _LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=()), tags=tags)
    _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
    op = getattr(torch.ops.nvfp4, fn.__name__)
    op.__doc__ = fn.__doc__
    return op


def _fake(op):
    """Decorator registering the fake (meta) implementation of the operator ``op``, which
    ``torch.compile`` traces instead of the kernels."""
    return torch.library.register_fake(f"nvfp4::{op.__name__}", lib=_LIB)


# --------------------------------------------------------------------------- generic operand op

# Any strides of a dense ``x`` (the kernels read through them), so inductor passes a tensor that
# several quantizations read (the backward's E, for dgrad and wgrad) as one buffer. (Under its
# default constraint, exact strides, it made a copy of an unrealized input for each consumer.)
@_op(tags=(torch.Tag.flexible_layout,))
def quantize_operand(
    x: Tensor, x_scales: Optional[Tensor], src: int, transpose: bool, in_scale: Optional[Tensor],
    signs: Optional[Tensor], prev_amax: Optional[Tensor], uniforms: Optional[Tensor],
    seed: Optional[Tensor], stream: int, mode: str, four_over_six: bool, values: bool, pack: bool,
    posthoc: bool = False, amax: Optional[Tensor] = None, eden_correction: str = "chunk_scaled",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Any quantizer on any operand: dense (``src=0``, ``x`` float, times ``in_scale``) or packed
    NVFP4 (``src=1`` 1×16 / ``2`` 16×16: ``x`` uint8 codes, ``x_scales`` uint8 E4M3 bits,
    ``in_scale`` its tensor scale), optionally rotated by ``signs``. ``amax``: the operand's
    ``max |A|`` when the caller has it (then no amax pass runs; under ``torch.compile`` inductor
    computes it, fused with the kernel that produced ``x``). ``eden_correction``: MS-EDEN's
    step 4, ``"chunk_scaled"`` or ``"energy"`` (:class:`QuantizeCall`). Returns
    ``(values, codes, scales, tensor_scale, amax)`` (see the module docstring)."""
    return quantize(QuantizeCall(**locals()))  # the op's parameters are QuantizeCall's fields


@_fake(quantize_operand)
def _(x, x_scales, src, transpose, in_scale, signs, prev_amax, uniforms, seed, stream, mode,
      four_over_six, values, pack, posthoc=False, amax=None, eden_correction="chunk_scaled"):
    return quantize_fake(QuantizeCall(**locals()))


# --------------------------------------------------------------------------- named quantizers

_PARAMETER_TYPES = {
    "x": Tensor, "signs": Tensor, "transpose": bool, "uniforms": Optional[Tensor],
    "seed": Optional[Tensor], "four_over_six": bool, "amax": Optional[Tensor], "pack": bool,
    "stream": int, "posthoc": bool, "eden_correction": str,
}
"""The annotation of each parameter of the named quantizers, from which their schemas come."""

_REQUIRED = inspect.Parameter.empty

_NAMED_QUANTIZERS = (
    # (op name, QuantizeCall mode, the op's parameters in order with their defaults, docstring)
    ("rtn", "rtn", dict(x=_REQUIRED, transpose=False, four_over_six=False, amax=None, pack=True),
     "RTN 1×16 (optionally 4/6) of ``x`` (rows) or ``xᵀ`` (``transpose``, i.e. along columns)."),
    ("rtn_2d", "rtn_2d", dict(x=_REQUIRED, transpose=False, four_over_six=False, amax=None, pack=True),
     "RTN with one scale per 16×16 tile (optionally 4/6)."),
    ("sr", "sr", dict(x=_REQUIRED, transpose=False, uniforms=None, seed=None, four_over_six=False,
                      amax=None, pack=True, stream=0),
     "Stochastic rounding 1×16 (``four_over_six``: the biased ablation)."),
    ("rht_ms_eden", "ms_eden", dict(x=_REQUIRED, signs=_REQUIRED, transpose=False, uniforms=None,
                                    seed=None, amax=None, pack=False, stream=0, posthoc=False,
                                    eden_correction="chunk_scaled"),
     """Randomized Hadamard transform (chunks of ``len(signs)``) fused with MS-EDEN; ``posthoc``:
    with post hoc range alignment (no amax pass; ``amax`` then returns ``max(c)``);
    ``eden_correction``: step 4's S, ``"chunk_scaled"`` (SPEC §2) or ``"energy"`` (groups
    weighted by their block scale squared, docs/spec.md §5)."""),
    ("rht_sr", "sr", dict(x=_REQUIRED, signs=_REQUIRED, transpose=False, uniforms=None, seed=None,
                          amax=None, pack=False, stream=0),
     "Randomized Hadamard transform fused with SR (tetrajet_v2's backward, nvidia's Eᵀ)."),
    ("rht_rtn", "rtn", dict(x=_REQUIRED, signs=_REQUIRED, transpose=False, amax=None, pack=False),
     "Randomized Hadamard transform followed by RTN 1×16 (nvidia's Xᵀ in wgrad)."),
)
"""The named quantizers: each is :func:`quantize_operand` with the quantizer ``mode`` fixed and
a few of its parameters, under the names of :class:`QuantizeCall` (``amax``: its
``prev_amax``, the delayed amax)."""


def _named_quantizer(name: str, mode: str, defaults: dict, doc: str):
    """Register the operator ``nvfp4::<name>`` (and its fake) of one :data:`_NAMED_QUANTIZERS`
    entry, and return it."""
    signature = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d,
                           annotation=_PARAMETER_TYPES[p]) for p, d in defaults.items()],
        return_annotation=tuple[Tensor, Tensor, Tensor, Tensor, Tensor])

    def call(*args, **kwargs) -> QuantizeCall:  # the dispatcher passes the arguments in order
        fields = {**defaults, **dict(zip(defaults, args)), **kwargs}
        return QuantizeCall(mode=mode, prev_amax=fields.pop("amax"), **fields)

    def kernel(*args, **kwargs):
        return quantize(call(*args, **kwargs))

    kernel.__name__, kernel.__doc__, kernel.__signature__ = name, doc, signature
    op = _op(kernel)
    _fake(op)(lambda *args, **kwargs: quantize_fake(call(*args, **kwargs)))
    return op


rtn, rtn_2d, sr, rht_ms_eden, rht_sr, rht_rtn = (_named_quantizer(*entry) for entry in _NAMED_QUANTIZERS)


# --------------------------------------------------------------------------- helpers

@_op
def amax(x: Tensor, transpose: bool = False, signs: Optional[Tensor] = None,
         in_scale: Optional[Tensor] = None) -> Tensor:
    """``max |A|`` (FP32 0-dim) of ``A = x`` or ``xᵀ``, after the rotation when ``signs``."""
    return _amax_impl(x, None, SRC_DENSE, transpose, in_scale, signs)


@_fake(amax)
def _(x, transpose=False, signs=None, in_scale=None):
    return torch.empty((), dtype=torch.float32, device=x.device)


@_op
def unpack(data: Tensor, scales: Tensor, tile2d: bool = False) -> Tensor:
    """BF16 ``q · s_block`` of a packed tensor (``R × C/2`` codes, E4M3 scales)."""
    R, C = data.shape[0], data.shape[1] * 2
    data, scales = data.contiguous(), scales.contiguous()
    out = torch.empty((R, C), dtype=torch.bfloat16, device=data.device)
    if R and C:
        bm, bk, nw = _config("rows")
        _launch(K.unpack_kernel, (_cdiv(R, bm), _cdiv(C, bk)), dict(
            x_ptr=data, xs_ptr=scales.view(torch.uint8), val_ptr=out, NR=R, NC=C),
            SRC=SRC_PACKED_2D if tile2d else SRC_PACKED, BM=bm, R=bk // GROUP, num_warps=nw)
    return out


@_fake(unpack)
def _(data, scales, tile2d=False):
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=torch.bfloat16)


_RAND_KINDS = {"sr": 0, "ms_eden": 1, "signs": 2}


def _philox_draws(seed: Tensor, stream: int, n: int, kind: str, groups: int = 1) -> Tensor:
    if kind not in _RAND_KINDS:
        raise ValueError(f"philox draws kind must be one of {sorted(_RAND_KINDS)}, got {kind!r}")
    out = torch.empty(n, dtype=torch.int8 if kind == "signs" else torch.float32, device=seed.device)
    if n:
        block = 65536 if _INTERPRET else 1024
        _launch(K.rand_kernel, (_cdiv(n, block),),
                dict(seed_ptr=seed, out_ptr=out, N=n, G=groups, stream=stream),
                KIND=_RAND_KINDS[kind], BLOCK=block, num_warps=4)
    return out


@_op
def philox_uniforms(seed: Tensor, n: int, mode: str = "sr", stream: int = 0,
                    groups: int = 0) -> Tensor:
    """The draws of the seeded kernels for flat offsets ``i < n`` of ``stream``: SR's
    (``mode="sr"``, ``P(i // 4)[i % 4]``; reshape to the operand's ``M × K``) or MS-EDEN's
    (``mode="ms_eden"``, group ``i % groups`` of row ``i // groups``, ``groups = K/16``, as
    ``triton_kernels._eden_draw``; reshape to ``M × K/16``)."""
    if mode not in ("sr", "ms_eden"):
        raise ValueError(f"philox_uniforms mode must be 'sr' or 'ms_eden', got {mode!r}")
    if mode == "ms_eden" and (groups <= 0 or n % groups):
        raise ValueError(f"MS-EDEN's draws depend on the row length: pass groups = K/16 > 0 "
                         f"dividing n = {n}, got groups = {groups}")
    return _philox_draws(seed, stream, n, mode, max(groups, 1))


@_fake(philox_uniforms)
def _(seed, n, mode="sr", stream=0, groups=0):
    return seed.new_empty((n,), dtype=torch.float32)


@_op
def philox_signs(seed: Tensor, h: int, stream: int = 0) -> Tensor:
    """Random Hadamard signs ``σ ∈ {±1}^h`` (int8) from the kernels' Philox generator:
    ``σ_j = +1`` when ``P(j)[0]`` of ``stream`` is odd."""
    return _philox_draws(seed, stream, h, "signs")


@_fake(philox_signs)
def _(seed, h, stream=0):
    return seed.new_empty((h,), dtype=torch.int8)


_ROUND_TO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def scale_product(acc: Tensor, scale_a: Optional[Tensor], scale_b: Optional[Tensor],
                  dtype: torch.dtype, out_dtype: torch.dtype) -> Tensor:
    """``(acc · (scale_a · scale_b)).to(dtype).to(out_dtype)`` in one pass: the epilogue of an
    emulated NVFP4 GEMM (``quant.linear._product``) on its FP32 accumulator ``acc``, with FP32
    0-dim tensor scales (None = 1), rounded once to ``dtype`` (float32, bfloat16 or float16)."""
    if dtype not in _ROUND_TO:
        raise ValueError(f"scale_product rounds to one of {tuple(_ROUND_TO)}, got {dtype}")
    acc = acc.contiguous()
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    n = acc.numel()
    if n:
        block = 65536 if _INTERPRET else 2048
        dummy = scale_a if scale_a is not None else scale_b if scale_b is not None else acc
        _launch(K.scale_kernel, (_cdiv(n, block),), dict(
            y_ptr=acc, sa_ptr=scale_a if scale_a is not None else dummy,
            sb_ptr=scale_b if scale_b is not None else dummy, out_ptr=out, N=n),
            HAS_A=scale_a is not None, HAS_B=scale_b is not None, ROUND=_ROUND_TO[dtype],
            BLOCK=block, num_warps=4)
    return out
