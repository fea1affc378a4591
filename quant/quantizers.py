"""Reference NVFP4 quantizers in pure PyTorch (SPEC §2): the source of truth for the kernels.

Every quantizer groups 16 consecutive elements along ``dim`` (the reduction dimension of the
GEMM that consumes the tensor), computes in float32 and returns an :class:`NVFP4Tensor`.
Randomness is never drawn here: stochastic quantizers take their uniform draws as arguments
(in the layout of the input), so tests and kernels can replay them exactly.

Scale arithmetic shared by all quantizers (SPEC §2): ``s_t = max(amax / target_t, 2^-149)``
(:func:`~quant.format.tensor_scale`: the floor keeps a tensor scale that would round to 0, for an
amax below about ``target_t · 2^-150``, from making an all-zero group's scale ``0 / 0``),
``s_b = e4m3(amax_b / target_b / s_t)`` (a zero scale becomes 1), ``x_s = x / (s_b · s_t)`` with
the product ``s_b · s_t`` rounded once in float32, and ``x̂ = (q · s_b) · s_t``.
``amax`` may be given explicitly (delayed amax: reuse the previous call's value); values beyond
it then saturate.

Non-finite inputs (SPEC §1–2 are silent on NaN and ±inf; this is the rule of every quantizer
here and of the kernels of :mod:`quant.kernels`): **if any element of the tensor to quantize
(after its rotation, if any) is NaN or ±inf, the quantized tensor is NaN in every element**:
its tensor scale is NaN, so ``x̂ = q · s_b · s_t`` is NaN everywhere, and so is every GEMM
output that reduces over it (a NaN or inf gradient never comes out of a quantized GEMM finite,
let alone zero). The whole tensor, not only the group: the tensor scale is a function of the
tensor's amax, and no scale is meaningful for any group once that is non-finite. How each
quantizer gets there:

* with an amax (RTN, 16×16, SR, 4/6, MS-EDEN's amax pass): ``max |x|`` propagates NaN (and
  is +inf for an inf), and the tensor scale of a non-finite amax is NaN
  (:func:`~quant.format.tensor_scale`); a given (delayed) amax gives way to the tensor's own
  when that is non-finite (:func:`amax_of`), so a finite delayed amax cannot saturate an inf
  to ±6;
* post hoc MS-EDEN: a group holding NaN or ±inf has a NaN corrected scale ``c`` (its ``x_s``
  holds NaN, hence so do the EDEN sums), ``max(c)`` propagates NaN, and the power-of-two tensor
  scale of a NaN ``max(c)`` is NaN (:func:`~quant.format.pow2_scale_for`).

The codes and block scales of such a tensor carry no information: the kernels may store other
bytes there than the reference (their min/max instructions treat NaN differently); the rule
fixes the dequantized values and the NaN tensor scale, in the emulation and the packed form.

An empty tensor (a dimension of size 0) quantizes to an empty result with tensor scale 1, as
an all-zero tensor (the max of |x| over no elements is taken as 0), which is also what the
kernels return: a quantized linear layer then takes a micro-batch of no tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .format import (
    E2M1_MAX,
    E4M3_MAX,
    GROUP,
    NVFP4Tensor,
    check_groupable,
    e4m3_block_scale,
    e4m3_neighbours,
    fp32,
    pow2_scale_for,
    round_e2m1,
    round_e4m3_mantissa,
    tensor_scale,
    to_groups,
)

SR_TARGET = E2M1_MAX * 16 / 17
"""6' = 6·16/17: SR's pre-shrunk target, so an E4M3-rounded scale never pushes |x_s| past 6."""

FOUR_OVER_SIX_SCALE_MAX = 256.0
"""4/6 maps the tensor amax to block scale 256, so the 1.5× candidate (384) still fits E4M3."""

EDEN_TARGET = E2M1_MAX / ((17 / 16) * 0.93)
"""v = 6 / ((17/16)·0.93) ≈ 6.07: MS-EDEN's block target (0.93 is an MSE-tuned clip)."""

EDEN_SCALE_MAX = 255.99
"""MS-EDEN's tensor-scale headroom: the EDEN correction may raise a block scale."""

EDEN_CORRECTIONS = ("chunk_scaled", "energy")
"""MS-EDEN step 4 variants (:func:`quantize_ms_eden`'s ``correction``)."""


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by a fixed pairwise tree: ``v[:n/2] + v[n/2:]``
    repeated. A kernel that adds in the same order matches it bit for bit."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v


FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126


def chunk_sum(v: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the last dim (a multiple of 16, one rotation chunk) in a fixed order: each
    16-group by :func:`tree_sum`, then the group sums by :func:`tree_sum`. (A kernel holding a
    group in one thread adds it there, then combines one number per group across threads.)
    ``weights`` (one per group) gives ``Σ_g w_g Σ_i v_gi``, each group sum multiplied by its
    weight before the second tree."""
    groups = tree_sum(v.reshape(*v.shape[:-1], v.shape[-1] // GROUP, GROUP)).squeeze(-1)
    return tree_sum(groups if weights is None else groups * weights)


def amax_of(x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor amax ``max |x|`` (float32; NaN when ``x`` holds a NaN, 0 when ``x`` is empty),
    or the given (delayed) ``amax`` unless ``x``'s own amax is NaN or +inf, which then wins (the
    non-finite rule of the module docstring)."""
    current = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    if amax is None:
        return current
    return torch.where(current < math.inf, amax.float(), current)


def stochastic_round_e2m1(v: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Round to one of the two neighbouring E2M1 points, ``P(up) = (|v| − lo)/(hi − lo)``.

    ``|v|`` is clamped at 6 first. One uniform ``u ∈ [0, 1)`` per element; the value goes up when
    ``u < P(up)``, so ``E[round(v)] = v`` for ``|v| ≤ 6`` (SPEC §2, SR row). Every NaN bit
    pattern gives ``+0.0``, as in :func:`~quant.format.round_e2m1` (it becomes 0 before the
    bit-pattern arithmetic below).
    """
    a = v.float().abs().clamp(max=E2M1_MAX).nan_to_num_(0.0)
    # lo: the grid point at or below a, the multiples of 0.5 below 1 and FP32 truncated to one
    # mantissa bit from 1 up; the spacing there is half of a's power of two.
    b = a.view(torch.int32)
    small = a < 1
    lo = torch.where(small, torch.floor(a * 2) * 0.5, (b & -0x400000).view(torch.float32))
    step = torch.where(small, 0.5, (b & 0x7F800000).view(torch.float32) * 0.5)
    hi = (lo + step).clamp_(max=E2M1_MAX)
    gap = hi - lo
    p_up = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    mag = torch.where(uniforms < p_up, hi, lo)
    return torch.where(v < 0, -mag, mag)


def _grouped(x: torch.Tensor, dim: int) -> torch.Tensor:
    check_groupable(x.shape[dim], f"dimension {dim} of a tensor of shape {tuple(x.shape)}")
    return to_groups(x.float().movedim(dim, -1))


def _quantize_groups(
    xg: torch.Tensor,
    s_t: torch.Tensor,
    target: float,
    rounding: Callable[[torch.Tensor], torch.Tensor],
    four_over_six: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales and E2M1 values for groups along the last dim of ``xg`` (one scale each).

    With ``four_over_six`` (SPEC §2, 4/6 row) a second candidate maps the group amax to 4
    (scale ``e4m3(1.5 · raw)``); the candidate with the smaller squared error in the original
    domain is kept, ties going to 6. The squared errors are summed by :func:`tree_sum`.
    """
    raw = xg.abs().amax(-1, keepdim=True) / fp32(target, xg.device) / s_t
    s6 = e4m3_block_scale(raw)
    q6 = rounding(xg / (s6 * s_t))
    if not four_over_six:
        return q6, s6
    s4 = e4m3_block_scale(raw * 1.5)
    q4 = rounding(xg / (s4 * s_t))
    err6 = tree_sum((q6 * s6 * s_t - xg) ** 2)
    err4 = tree_sum((q4 * s4 * s_t - xg) ** 2)
    use4 = err4 < err6
    return torch.where(use4, q4, q6), torch.where(use4, s4, s6)


def _result(q: torch.Tensor, s_b: torch.Tensor, s_t: torch.Tensor, dim: int) -> NVFP4Tensor:
    return NVFP4Tensor(q=q.flatten(-2), block_scale=s_b.squeeze(-1), tensor_scale=s_t, dim=dim)


def quantize_rtn(
    x: torch.Tensor,
    dim: int = -1,
    four_over_six: bool = False,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """RTN 1×16 (SPEC §2): ``s_t = amax/(6·448)``, ``s_b = e4m3(amax_b/6/s_t)``, nearest-even E2M1.

    With ``four_over_six``: ``s_t = amax/(6·256)`` and per-group 4/6 selection.
    """
    xg = _grouped(x, dim)
    scale_max = FOUR_OVER_SIX_SCALE_MAX if four_over_six else E4M3_MAX
    s_t = tensor_scale(amax_of(x, amax), E2M1_MAX * scale_max)
    q, s_b = _quantize_groups(xg, s_t, E2M1_MAX, round_e2m1, four_over_six)
    return _result(q, s_b, s_t, dim)


def quantize_rtn_2d(
    w: torch.Tensor, four_over_six: bool = False, amax: torch.Tensor | None = None
) -> NVFP4Tensor:
    """RTN with one scale per 16×16 tile of a 2-D weight (SPEC §2, NVIDIA recipe).

    The result is valid as NVFP4 along both dims, so ``quantize_rtn_2d(w.T)`` equals the
    transpose of ``quantize_rtn_2d(w)``. Stored with ``tile="16x16"`` and grouped along dim -1.
    """
    if w.dim() != 2:
        raise ValueError(f"16×16 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    R, C = w.shape
    check_groupable(R, f"weight dim 0 (shape {tuple(w.shape)})")
    check_groupable(C, f"weight dim 1 (shape {tuple(w.shape)})")
    tiles = w.float().reshape(R // GROUP, GROUP, C // GROUP, GROUP).transpose(1, 2)
    tiles = tiles.reshape(R // GROUP, C // GROUP, GROUP * GROUP)
    scale_max = FOUR_OVER_SIX_SCALE_MAX if four_over_six else E4M3_MAX
    s_t = tensor_scale(amax_of(w, amax), E2M1_MAX * scale_max)
    q, s_b = _quantize_groups(tiles, s_t, E2M1_MAX, round_e2m1, four_over_six)
    q = q.reshape(R // GROUP, C // GROUP, GROUP, GROUP).transpose(1, 2).reshape(R, C)
    return NVFP4Tensor(q=q, block_scale=s_b.squeeze(-1), tensor_scale=s_t, tile="16x16")


def quantize_sr(
    x: torch.Tensor,
    uniforms: torch.Tensor,
    dim: int = -1,
    amax: torch.Tensor | None = None,
    four_over_six: bool = False,
) -> NVFP4Tensor:
    """Stochastic rounding 1×16 (SPEC §2): ``s_t = amax/(6'·448)``, ``s_b = e4m3(amax_b/6'/s_t)``.

    ``uniforms`` has the shape of ``x`` (one draw per element). ``four_over_six=True`` is the
    biased ablation of SPEC §3 (the 4/6 choice depends on the draw), the negative control of
    the unbiasedness tests; it uses 6'·256 for the tensor scale.
    """
    if uniforms.shape != x.shape:
        raise ValueError(f"SR needs one uniform per element: {tuple(uniforms.shape)} vs {tuple(x.shape)}")
    xg = _grouped(x, dim)
    ug = to_groups(uniforms.movedim(dim, -1))
    scale_max = FOUR_OVER_SIX_SCALE_MAX if four_over_six else E4M3_MAX
    s_t = tensor_scale(amax_of(x, amax), SR_TARGET * scale_max)
    q, s_b = _quantize_groups(
        xg, s_t, SR_TARGET, lambda v: stochastic_round_e2m1(v, ug), four_over_six
    )
    return _result(q, s_b, s_t, dim)


def stochastic_round_e4m3(c: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Round non-negative ``c`` to one of its E4M3 neighbours, ``P(up) = (c − down)/(up − down)``
    (SPEC §2, MS-EDEN step 5)."""
    down, up = e4m3_neighbours(c)
    gap = up - down
    p_up = torch.where(gap > 0, (c.clamp(max=E4M3_MAX) - down) / torch.where(gap > 0, gap, 1.0), 0.0)
    return torch.where(uniforms < p_up, up, down)


def _energy_weights(s_b: torch.Tensor, per_chunk: int) -> torch.Tensor:
    """``(s_g / 2^E)²`` per group, chunks of ``per_chunk`` groups along the last dim, ``2^E`` the
    largest power of two not above the chunk's largest block scale (1 for an all-zero chunk)."""
    s = s_b.reshape(*s_b.shape[:-1], s_b.shape[-1] // per_chunk, per_chunk)
    top = s.amax(-1, keepdim=True)
    _, e = torch.frexp(torch.where(top > 0, top, 1.0))
    return (s / torch.ldexp(torch.ones_like(top), e - 1)) ** 2


def quantize_ms_eden(
    x_rot: torch.Tensor,
    scale_uniforms: torch.Tensor,
    chunk: int = 128,
    dim: int = -1,
    amax: torch.Tensor | None = None,
    posthoc: bool = False,
    correction: str = "chunk_scaled",
) -> NVFP4Tensor:
    """MS-EDEN steps 2–6 (SPEC §2) on an input already rotated along ``dim`` in chunks of ``chunk``.

    2. ``s_t = amax/(255.99·v)``, ``s_b = e4m3(amax_b/v/s_t)`` with ``v = 6/((17/16)·0.93)``.
    3. ``q = rtn(x_s)``, ``x_s = x_rot/(s_b s_t)``, saturating at ±6.
    4. Per rotation chunk: ``S = Σ x_s² / Σ x_s q`` (1 when the denominator is 0; sums by
       :func:`chunk_sum`); ``c = s_b · S``.
    5. ``sr(c)``: stochastic rounding to an E4M3 neighbour, one uniform per 16-element group
       (``scale_uniforms`` has the shape of ``x_rot`` with ``dim`` divided by 16).
    6. ``x̂ = q · sr(c) · s_t``, left in the rotated basis.

    ``correction="energy"`` replaces step 4's S by the ratio over the unscaled values of the chunk,
    ``S = Σ_g s_g² Σ_i x_s,gi² / Σ_g s_g² Σ_i x_s,gi q_gi`` with ``s_g`` the group's block scale (the
    tensor scale cancels): each group weighs by its energy rather than equally, which removes the
    shrinkage that ``chunk_scaled`` (the paper's step 4) shows when the groups of a chunk have
    different scales (``docs/spec.md`` §5). The weights are ``(s_g / 2^E)²``, with ``2^E`` the
    largest power of two not above the chunk's largest block scale, so they lie in (0, 4) and the
    sums neither overflow nor underflow in FP32; the sums are :func:`chunk_sum`'s, weighted.

    ``posthoc=True`` is post hoc range alignment (SPEC §2, last paragraph), which needs no tensor
    amax before the elements are rounded, so a kernel quantizes in one pass over ``x_rot``:

    2'. provisional block scales ``s_p = m3(amax_b / v)``: rounded to E4M3's 3 mantissa bits but
        with FP32's exponent range (:func:`~quant.format.round_e4m3_mantissa`), so no tensor
        scale is needed yet (1 for an all-zero group; ``amax_b / v`` is taken at least 2^-126,
        FP32's smallest normal, so a group of subnormals gets a nonzero scale, and a group whose
        amax is at most 2^-128 rounds to 0: ``docs/spec.md`` §6.1, the range);
    3'. ``x_s = x_rot / s_p``; ``q = rtn(x_s)``, saturating at ±6;
    4'. S as in step 4, ``c = s_p · S`` (0 for an all-zero group, NaN for a group holding NaN
        or ±inf);
    5'. align: ``s_t`` = the smallest power of two with ``max(c) / s_t ≤ 448`` over the tensor
        (:func:`~quant.format.pow2_scale_for`; NaN when ``max(c)`` is), then ``sr(c / s_t)`` to
        an E4M3 neighbour as in step 5 (``c / s_t`` is exact);
    6'. ``x̂ = q · sr(c/s_t) · s_t``.

    Unbiased as MS-EDEN: ``E[sr(c/s_t)] · s_t = c``, so ``E[x̂] = q · s_p · S``, EDEN's corrected
    estimate (the element rounding happens before and independently of the scale's draw). Why
    the 3-bit mantissa and the power-of-two ``s_t``: then ``s_p / s_t`` is an E4M3 value (in
    its normal range), so the scale's stochastic rounding only rounds EDEN's correction S, as in
    MS-EDEN. Keeping ``s_p`` in full FP32 precision instead measured 4% more error than MS-EDEN
    on SPEC §5's protocol (10.16e-3 against 9.76e-3), because the draw then rounds the whole
    scale. ``amax`` (delayed) does not apply.
    """
    xg = _grouped(x_rot, dim)
    ug = scale_uniforms.movedim(dim, -1)
    if ug.shape != xg.shape[:-1]:
        raise ValueError(
            f"MS-EDEN needs one uniform per group of 16: expected {tuple(xg.shape[:-1])} "
            f"(grouped layout), got {tuple(ug.shape)}"
        )
    if chunk % GROUP or xg.shape[-2] % (chunk // GROUP):
        raise ValueError(f"MS-EDEN chunk {chunk} must be a multiple of 16 dividing dimension {dim}")
    if posthoc and amax is not None:
        raise ValueError("post hoc range alignment takes no amax (delayed amax does not apply to it)")
    raw = xg.abs().amax(-1, keepdim=True) / fp32(EDEN_TARGET, xg.device)
    if posthoc:
        s_b = torch.where(raw > 0, round_e4m3_mantissa(raw.clamp(min=FP32_TINY)), 1.0)
        x_s = xg / s_b
    else:
        s_t = tensor_scale(amax_of(x_rot, amax), EDEN_SCALE_MAX * EDEN_TARGET)
        s_b = e4m3_block_scale(raw / s_t)
        x_s = xg / (s_b * s_t)
    q = round_e2m1(x_s)
    per_chunk = chunk // GROUP
    xs_c = x_s.reshape(*x_s.shape[:-2], x_s.shape[-2] // per_chunk, per_chunk * GROUP)
    q_c = q.reshape(xs_c.shape)
    if correction not in EDEN_CORRECTIONS:
        raise ValueError(f"unknown MS-EDEN correction {correction!r}: use chunk_scaled or energy")
    w = _energy_weights(s_b.squeeze(-1), per_chunk) if correction == "energy" else None
    num = chunk_sum(xs_c * xs_c, w)
    den = chunk_sum(xs_c * q_c, w)
    S = torch.where(den != 0, num / torch.where(den != 0, den, 1.0), 1.0)
    c = s_b.squeeze(-1) * S.repeat_interleave(per_chunk, -2).squeeze(-1)
    if posthoc:
        c = torch.where(raw.squeeze(-1) == 0, 0.0, c)
        s_t = pow2_scale_for(amax_of(c))
        c = c / s_t
    scale = stochastic_round_e4m3(c, ug)
    return NVFP4Tensor(q=q.flatten(-2), block_scale=scale, tensor_scale=s_t, dim=dim)
