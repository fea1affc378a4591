"""Triton kernels of the NVFP4 quantizers (SPEC §2), bit-exact with :mod:`quant.quantizers`.

Every kernel works on a *logical* 2-D operand ``A`` (``M × K``, groups of 16 along ``K``, the GEMM's
reduction dim). ``A`` is read through strides, so ``A = X`` and ``A = Xᵀ`` are the same kernel:
an operand read across memory rows (``COLS``) is loaded as 16 row-wise slices joined in
registers when each thread holds whole groups (``GROUPS``, :func:`_load_groups_cols`), else in
memory order and transposed on chip (:func:`_load_tile_cols`; on the GPU the launcher may run
:func:`transpose_kernel` first instead, ``quant.kernels.KernelTuning.transpose_cols``).
``A`` is either dense (any float dtype, optionally times an FP32 tensor scale) or a packed NVFP4
tensor (two E2M1 codes per byte + E4M3 scales, 1×16 or 16×16), possibly transposed.

Two passes per quantization, as the tensor scale depends on a whole-tensor maximum and the
tensor does not fit on chip. RTN, SR and 4/6 (and MS-EDEN with ``range_alignment=amax``):
:func:`amax_kernel` reads ``A`` (rotating it if asked) and ``atomic_max``-es ``max |A|`` into an
FP32 scalar; :func:`quant_kernel` reads ``A`` again and writes the GEMM-ready values
``q · s_block`` in BF16 and, optionally, the packed storage form. MS-EDEN with post hoc range
alignment (the default): :func:`quant_kernel` (``POSTHOC``) reads ``A`` once and writes the values
(``q · s_block · s_tensor``: the tensor scale is a power of two, exact to fold), the codes if
the packed form is wanted, and the corrected scales with their stochastic roundings,
``atomic_max``-ing the largest and storing each program's least positive one; the light
:func:`eden_align_kernel` then sets the tensor scale, reads the scales' E4M3 bits off those
roundings when the packed form is wanted and rewrites the rare groups whose values depended on
the tensor scale, if there are any (usually not: it then reads only the programs' minima).

Bit-exactness rules (the reference is the contract):
* every FP32 division is ``tl.math.div_rn`` (Triton's ``/`` is an approximate division on GPUs)
  or :func:`_div_groups` (the same quotient, by a per-group divisor), except by powers of two,
  which are multiplications by their exact reciprocals;
* launch with ``enable_fp_fusion=False`` so that no multiply–add pair is contracted to an FMA;
* the Hadamard butterfly and the EDEN chunk sums are fixed trees of single additions, each a
  sum over a size-2 axis of the reshaped tile, in the order of :func:`quant.hadamard.fwht` and
  :func:`quant.quantizers.chunk_sum`;
* values are clamped to 448 before every E4M3 cast;
* constants are passed already rounded to FP32 (as torch rounds a Python float divisor).

Non-finite inputs follow the rule of :mod:`quant.quantizers` (a NaN or ±inf anywhere in ``A``
makes the whole quantized tensor NaN through a NaN tensor scale): the tensor-wide maxima, the
amax and post hoc MS-EDEN's ``max(c)``, are integer maxima of FP32 bit patterns
(:func:`_abs_bits`), which keep NaN on every backend (``tl.max`` of floats drops it, on the GPU
and in the interpreter alike; :func:`_group_scales` says why the groups' maxima need not); the
tensor scale of a non-finite amax or ``max(c)`` is NaN; and the post hoc align pass then
rewrites every value of the tensor (:func:`_align_tile`).

Random draws: explicit uniforms (``RAND=0``, for tests: the layout of the logical operand, one
per element for SR and one per 16-group for MS-EDEN) or Philox (``RAND=1``) with key ``seed``
(an int64 scalar read from memory, the step key of :mod:`quant.randomness`) and the stream
number ``stream`` as the second counter word, i.e. ``P(i) = philox(seed, (i, stream, 0, 0))``,
four uint32 per call: SR element (m, k) of ``A`` (flat index ``i = m·K + k``) draws
``P(i // 4)[i % 4]``; MS-EDEN group g of row m draws
``P((m·B + g // 32)·8 + g % 8)[(g // 8) % 4]`` with ``B = ⌈K/512⌉`` blocks of 32 groups per
row, so that the groups g, g + 8, g + 16, g + 24 of a block share one call (:func:`_eden_draw`);
Hadamard sign j is ``+1`` when
``P(j)[0]`` is odd. (Stream 0 is triton's ``tl.rand4x(seed, ·)`` stream.)
:func:`rand_kernel` materialises any of them for ``i = 0..n-1``, i.e. exactly what the seeded
path uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Quantizer modes of quant_kernel.
MODE_RTN = 0
MODE_SR = 1
MODE_EDEN = 2

_POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _nan_unless(ok, v):
    """``v`` where ``ok``, else NaN (made from its bit pattern: a NaN constant as a global would
    fail triton's check that a kernel's globals are unchanged since its compilation, NaN ≠ NaN)."""
    return tl.where(ok, v, tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _tensor_scale(amax, T_TENSOR: tl.constexpr):
    """``quant.format.tensor_scale(amax, T_TENSOR)``: ``max(amax / T_TENSOR, 2^-149)``, 1 for a
    zero amax, NaN for a NaN or +inf one. 2^-149 is made from its bit pattern (1), a select
    rather than a float max, so that no flush of subnormals can touch it."""
    s_t = tl.math.div_rn(amax, T_TENSOR)
    s_t = tl.where(s_t > 0, s_t, tl.full((), 1, tl.int32).to(tl.float32, bitcast=True))
    s_t = tl.where(amax > 0, s_t, 1.0)
    return _nan_unless(amax < _POS_INF, s_t)


@triton.jit
def _abs_bits(v):
    """The int32 bit pattern of FP32 ``|v|``: non-negative patterns order as the values do and
    every NaN's lies above +inf's, so an integer max of them is ``max |v|`` that keeps NaN
    (``tl.max`` of floats and ``tl.maximum`` drop NaN on the GPU, whose max instruction returns
    the other operand). Back to FP32 by ``.to(tl.float32, bitcast=True)``."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _e4m3_bits(v):
    """uint8 bits of e4m3(v) for v >= 0 (round to nearest even, saturating at 448)."""
    return tl.minimum(v, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _e4m3_value(bits):
    return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _tiny_factor(d):
    """2^64 for the per-group divisors below 2^-64, else 1 (:func:`_div_groups`)."""
    return tl.where(d < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)


@triton.jit
def _div_groups(xf, d, f):
    """``x / d`` for a ``[BM, CH, R, 16]`` tile and per-group divisors ``d`` ``[BM, CH, R]``,
    given ``xf = x · f`` for a per-group power of two ``f`` with ``d · f ≥ 2^-64``
    (:func:`_tiny_factor` of ``d`` or of a smaller divisor), rounded as one IEEE division
    (``tl.math.div_rn``) at a third of its cost: one correctly rounded reciprocal ``y = 1/(d·f)``
    per group, then per element ``q0 = xf·y``, the exact residual ``r = xf − q0·d·f`` (an FMA)
    and ``q = q0 + r·y`` (an FMA): the last step of the GPU's own division, which is correctly
    rounded for a reciprocal at least this accurate (Markstein's theorem). Scaling both by
    ``f`` is exact and keeps the quotient, ``y`` finite and the residual representable."""
    d = d * f
    y = tl.expand_dims(tl.math.div_rn(1.0, d), 3)
    q0 = xf * y
    r = tl.math.fma(q0 * -1.0, tl.expand_dims(d, 3), xf)
    return tl.math.fma(r, y, q0)


@triton.jit
def _block_scale(raw):
    """``e4m3_block_scale``: e4m3(raw) with 0 replaced by 1. Returns (fp32 value, uint8 bits)."""
    bits = _e4m3_bits(raw)
    bits = tl.where(bits == 0, 0x38, bits).to(tl.uint8)
    return _e4m3_value(bits), bits


@triton.jit
def _e2m1_as_e4m3(code):
    """uint8 E4M3 bits of ``E2M1(code) · 2^-6`` for a 4-bit code (int32 0..15; bit 3 is the
    sign): the code's exponent and mantissa bits ``e1 e0 m`` moved into E4M3's ``0 e1 e0 m 0 0``
    of exponent and mantissa (both biases differ by 6: E2M1's subnormal 0.5 is E4M3's 2^-7 and
    ``(1 + m/2) · 2^(e−1)`` is ``(1 + m/2) · 2^(e−7)``), the sign bit to bit 7. Converting
    E4M3 to FP32 is one instruction per pair of elements on Hopper (``F2FP.F16.E4M3``)."""
    return (((code & 8) << 4) | ((code & 7) << 2)).to(tl.uint8)


@triton.jit
def _e2m1_value(code):
    """Signed value of a 4-bit E2M1 code (int32 0..15; code 8 is −0, as ``decode_e2m1``)."""
    return _e4m3_value(_e2m1_as_e4m3(code)) * 64.0


@triton.jit
def _byte_codes(byte, SHAPE: tl.constexpr):
    """The two 4-bit codes of each byte (element 2i in the low nibble), interleaved along the
    last axis: ``[..., n]`` bytes to ``SHAPE = [..., 2n]`` codes."""
    return tl.reshape(tl.join(byte & 15, byte >> 4), SHAPE)


@triton.jit
def _packed_scales(xs_ptr, row, group, mask, P_C, SRC: tl.constexpr):
    """E4M3 block scales (FP32) of a packed ``R × C`` tensor (``C = P_C``) at physical ``row``
    and 16-group ``group``: one per row and group (SRC 1, 1×16) or per 16×16 tile (SRC 2)."""
    if SRC == 1:
        r = row
    else:
        r = row // 16
    return _e4m3_value(tl.load(xs_ptr + r * (P_C // 16) + group, mask=mask, other=0))


@triton.jit
def _group_uniforms(u_ptr, seed, stream, gm, g, mask, K, RAND: tl.constexpr):
    """MS-EDEN's draw of group ``g`` of row ``gm``: explicit (RAND 0, ``M × K/16``) or Philox
    under the key ``seed`` (:func:`_load_key`, :func:`_eden_draw`).
    (One return after an if/else: triton's compiler also compiles the statements after a
    return inside a constexpr branch, and Philox on RAND 0's placeholder FP32 seed fails.)"""
    if RAND == 0:
        u = tl.load(u_ptr + gm * (K // 16) + g, mask=mask, other=0.0)
    else:
        offset, slot = _eden_draw(gm, g, K)
        r0, r1, r2, r3 = _philox(seed, stream, offset)
        u = tl.uint_to_uniform_float(_pick(r0, r1, r2, r3, slot))
    return u


@triton.jit
def _eden_draw(gm, g, K):
    """Philox offset and output of MS-EDEN's group ``g`` of row ``gm`` (module docstring): a
    row's groups in blocks of 32, where the four groups of a block with the same ``g % 8``
    share a call and take its outputs ``(g // 8) % 4``. A program of :func:`quant_kernel` that
    quantizes four consecutive 128-column tiles of one block then draws once for all four (its
    ``SHARED_U``): rows of post hoc MS-EDEN at 16384×4096 on an H200 (triton 3.6, 2026-11) took
    122.6–123.8 µs and 42.9 SASS instructions per element in the loop, against 130.7 µs and
    47.1 when each group drew its own call."""
    return (gm * ((K // 16 + 31) // 32) + g // 32) * 8 + g % 8, (g // 8) % 4


@triton.jit
def _pick(r0, r1, r2, r3, slot):
    """``(r0, r1, r2, r3)[slot]``, elementwise."""
    return tl.where(slot == 0, r0, tl.where(slot == 1, r1, tl.where(slot == 2, r2, r3)))


@triton.jit
def _load_key(seed_ptr, RAND: tl.constexpr):
    """The Philox key (RAND 1), loaded once at the start of a kernel so that its latency hides
    behind the tile's work (RAND 0 passes a placeholder pointer: 0)."""
    seed = 0
    if RAND == 1:
        seed = tl.load(seed_ptr)
    return seed


@triton.jit
def _e2m1_spacing(a):
    """E2M1's grid around ``a`` in [0, 6] (SPEC §1): its points are ``n · gap`` with the gap 1/2
    below 2, 1 below 4 and 2 above, i.e. code ``n + off`` (off 0, 2, 4). Returns
    ``(y = a / gap, gap, off)``; ``y`` is exact (a power-of-two multiply) and at most 4."""
    lo2 = a < 2.0
    lo4 = a < 4.0
    y = a * tl.where(lo2, 2.0, tl.where(lo4, 1.0, 0.5))
    return y, tl.where(lo2, 0.5, tl.where(lo4, 1.0, 2.0)), tl.where(lo2, 0, tl.where(lo4, 2, 4))


@triton.jit
def _with_sign(mag, code, v):
    """Value and 4-bit code of the E2M1 magnitude ``mag`` (code ``code``) with the sign of v
    (``−0`` and code 8 for a negative v rounded to 0, as the reference)."""
    neg = v < 0
    return tl.where(neg, mag * -1.0, mag), code + tl.where(neg, 8, 0)


@triton.jit
def _rtn_e2m1(v, M_BITS: tl.constexpr):
    """Nearest-even E2M1 of v (saturating at 6). Returns (signed value fp32, 4-bit code int32).

    ``a = min(|v|, 6)`` plus ``M = 1.5·2^22`` (below 2), ``1.5·2^23`` (below 4) or ``1.5·2^24``
    lies in M's binade, whose spacing is E2M1's there (½, 1, 2), so ``(a + M) − M`` is the
    nearest grid point, ties to the even multiple (M is an even multiple). Ties land as the
    reference's: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4. The code
    is read off ``a + M`` itself (below).

    M is ``1.5 · 2^(22 + e)`` for a's binary exponent e clamped to [0, 2]. With M_BITS it is
    built on the bit pattern (a's exponent field, at least 1.0's, plus 22 in the exponent and
    M's mantissa bit: three integer instructions), else selected by comparing a with 2 and 4
    (two compares, two selects). The same M either way; H200, triton 3.6, 16384×4096, 2026-11:
    with the bit pattern RTN+4/6 rows take 212.3 µs against 224.4 selecting, RTN 1×16 138.0
    against 141.9, but post hoc MS-EDEN rows 152.0 against 147.3 (93 registers instead of 72),
    so MS-EDEN selects."""
    a = tl.minimum(tl.abs(v), 6.0)
    if M_BITS:
        mb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + 0x0B400000
        big = mb.to(tl.float32, bitcast=True)
    else:
        big = tl.where(a < 2.0, 6291456.0, tl.where(a < 4.0, 12582912.0, 25165824.0))
        mb = big.to(tl.int32, bitcast=True)
    t = a + big
    # t = M + n · spacing is M's bit pattern plus n, the grid index (0…4, 2…4, 2…3 in the
    # three binades), and the code is n + 0, 2, 4, the offset being M's bits >> 22 minus 299.
    return _with_sign(t - big, (t.to(tl.int32, bitcast=True) - mb - 299) + (mb >> 22), v)


@triton.jit
def _sr_e2m1(v, u):
    """Stochastic E2M1 rounding of v with uniform u (``stochastic_round_e2m1``).

    ``|v|`` clamped at 6 lies between the grid points ``lo = floor(y) · gap`` and ``lo + gap``
    (:func:`_e2m1_spacing`); ``P(up) = (a − lo) / gap = y − floor(y)``, which is exact and equal
    to the reference's quotient (``a − lo`` is exact by Sterbenz, the gap a power of two). At 6,
    ``P(up) = 0``."""
    y, gap, off = _e2m1_spacing(tl.minimum(tl.abs(v), 6.0))
    lo = tl.floor(y)
    n = tl.where(u < y - lo, lo + 1.0, lo)
    return _with_sign(n * gap, n.to(tl.int32) + off, v)


@triton.jit
def _sr_grid(c, u, E_MIN: tl.constexpr):
    """c >= 0 to one of its neighbours on the grid of 4 significant bits whose binary exponents
    are at least ``E_MIN``, ``P(up) = (c − down)/(up − down)`` with the uniform ``u``.

    The neighbours come from c's binary exponent e (at least ``E_MIN``): the grid step there is
    ``2^(e−3)``, so ``down = floor(c / step) · step`` and ``up = down + step`` (``down == up ==
    c`` when c is on the grid), all exact; dividing by the power-of-two step is a multiplication
    by its exact reciprocal. ``E_MIN = −6`` is E4M3 below 448 (its subnormals' spacing),
    :func:`_sr_e4m3`; ``E_MIN = −123`` (the least with a normal FP32 step) is E4M3's mantissa
    with FP32's exponent range, :func:`_sr_m3`. (Reading the neighbours off the bit pattern ±1,
    as ``quant.format.e4m3_neighbours`` does, gave wrong neighbours on the H200 with triton
    3.6.)"""
    e = tl.maximum(((c.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, E_MIN)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)
    down = tl.floor(c * inv_step) * step
    up = tl.where(down < c, down + step, down)
    return tl.where(u < (c - down) * inv_step, up, down)


@triton.jit
def _sr_e4m3(c, u):
    """``stochastic_round_e4m3``: c >= 0 to one of its E4M3 neighbours. Returns (value, bits)."""
    val = _sr_grid(tl.minimum(c, 448.0), u, -6)
    return val, _e4m3_bits(val)


@triton.jit
def _sr_m3(c, u):
    """MS-EDEN's scale rounding before the tensor scale is known (post hoc range alignment):
    ``sr(c / s_t) · s_t`` for any power of two ``s_t`` that puts ``c / s_t`` in E4M3's normal
    range [2^-6, 448], when ``c ≥ 2^-123`` (then c's grid scaled by ``s_t`` is E4M3's grid at
    ``c / s_t``). :func:`eden_align_kernel` fixes the groups where it is not."""
    return _sr_grid(c, u, -123)


@triton.jit
def _round_mantissa3(v):
    """``quant.format.round_e4m3_mantissa``: v >= 0 to 3 mantissa bits, nearest even."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _pow2_scale_448(c_max):
    """``quant.format.pow2_scale_for(c_max, 448)``: the smallest power of two s with
    ``c_max / s ≤ 448 = 1.75·2^8`` (1 when c_max is 0, NaN when it is NaN or +inf)."""
    b = c_max.to(tl.int32, bitcast=True)
    k = ((b >> 23) - 135) + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.maximum(k, -126)
    s = tl.where(c_max > 0, ((k + 127) << 23).to(tl.float32, bitcast=True), 1.0)
    return _nan_unless(c_max < _POS_INF, s)


@triton.jit
def _halve_sum(v, AX: tl.constexpr, SHAPE: tl.constexpr):
    """Add the two halves of axis ``AX`` (``v[.., :n/2, ..] + v[.., n/2:, ..]``): ``v`` is
    viewed as ``SHAPE``, in which axis ``AX`` has size 2, and that axis is summed. A sum over two
    elements is one IEEE addition (commutative), so it is exact to the reference's order."""
    return tl.sum(tl.reshape(v, SHAPE), axis=AX)


@triton.jit
def _tree_sum_last(v, P: tl.constexpr, Q: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """``tree_sum`` over the last dim of a ``[P, Q, N]`` tensor. Returns ``[P, Q]``."""
    for s in tl.static_range(LOG_N):
        v = _halve_sum(v, 2, (P, Q, 2, N >> (s + 1)))
    return tl.reshape(v, (P, Q))


@triton.jit
def _butterfly(v, AX: tl.constexpr, SHAPE: tl.constexpr, LO):
    """One in-place Walsh–Hadamard stage on ``v`` viewed as ``SHAPE``, whose axis ``AX`` (size 2)
    holds the pairs ``(a, b)``: ``(a, b) ← (a + b, a − b)`` (``quant.hadamard.fwht``).

    Each element takes its partner ``p``, read from the integer sum of the pair's bit patterns
    (``(a + b) − a = b``, exact modulo 2^32: one exchange between lanes when the pair spans two,
    none in registers), and computes ``p + v`` (the lower, a + b) or ``p + (−v)`` (the upper,
    a − b): IEEE defines ``a − b`` as ``a + (−b)``, zeros' signs included, and addition is
    commutative, so both are the reference's operations. Both are one ``fma(v, ±1, p)``: the
    product is exact, so the FMA rounds once, as the addition (one instruction where the
    pair spans two lanes, instead of a select and an add)."""
    y = tl.reshape(v, SHAPE)
    bits = y.to(tl.int32, bitcast=True)
    p = (tl.sum(bits, axis=AX, keep_dims=True) - bits).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.math.fma(y, tl.where(LO, 1.0, -1.0), p)


@triton.jit
def _pair_index(AX: tl.constexpr):
    """``True`` at index 0 of axis ``AX`` (3 or 4) of a rank-6 tensor, broadcastable."""
    i = tl.arange(0, 2)
    if AX == 3:
        i = i[None, None, None, :, None, None]
    else:
        i = i[None, None, None, None, :, None]
    return i == 0


@triton.jit
def _fwht(x, BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr):
    """``fwht`` (without the 1/√h) on the chunks ``[R, 16]`` (h = 16·R) of a ``[BM, CH, R, 16]``
    tile, chunk index ``16·r + j``: stage ``s`` pairs the indices that differ in bit ``s`` (bits
    0–3 on the last axis, 4… on the R axis), the lower one as ``a``."""
    for s in tl.static_range(4):
        x = _butterfly(x, 4, (BM, CH, R, 8 >> s, 2, 1 << s), _pair_index(4))
        x = tl.reshape(x, (BM, CH, R, 16))
    for s in tl.static_range(LOG_R):
        x = _butterfly(x, 3, (BM, CH, R >> (s + 1), 2, 1 << s, 16), _pair_index(3))
        x = tl.reshape(x, (BM, CH, R, 16))
    return x


@triton.jit
def _chunk_sum(v, w, WEIGHTED: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr,
               LOG_R: tl.constexpr):
    """``chunk_sum`` over each chunk ``[R, 16]`` of a ``[BM, CH, R, 16]`` tile: each 16-group
    by ``tree_sum`` (within a thread), then the R group sums by ``tree_sum``; WEIGHTED:
    ``chunk_sum(v, w)``, ``Σ_g w_g Σ_i v_gi``, each group sum times its weight ``w``
    ``[BM, CH, R]`` before the second tree. Returns ``[BM, CH, 1]``, to broadcast over the
    chunk's groups."""
    v = tl.reshape(_tree_sum_last(tl.reshape(v, (BM * CH, R, 16)), BM * CH, R, 16, 4), (BM, CH, R))
    if WEIGHTED:
        v = v * w
    for s in tl.static_range(LOG_R):
        v = _halve_sum(v, 2, (BM, CH, 2, R >> (s + 1)))
    return v


@triton.jit
def _energy_weights(s):
    """``quant.quantizers._energy_weights`` of the block scales ``s`` ``[BM, CH, R]`` (CH
    rotation chunks of R groups): ``w_g = (s_g / 2^E)²`` with ``2^E`` the largest power of two
    not above the chunk's largest scale ``top`` (1 where that is 0).

    The scales are normal floats below 2^126 (E4M3 ones at least 2^-9, post hoc ``s_p`` at
    least 2^-126), so ``2^E`` is ``top``'s FP32 exponent field, ``top & 0x7F800000``, and its
    reciprocal ``2^-E`` the normal float of bits ``0x7F000000 − (top & 0x7F800000)`` (biased
    exponent ``254 − e``): ``s_g · 2^-E`` is then the reference's quotient ``s_g / 2^E``,
    rounded once, with no division (a ``tl.math.div_rn`` for ``2^-E`` took the tensor-amax rows
    to 122 registers, against 80 this way and 79 under chunk_scaled: ``scripts/kernel_report.py``,
    sm_90 offline, triton 3.7). ``s_g / 2^E`` has at most 4 significant bits, so its square is
    exact unless it falls below FP32's normal range, where both round it alike. Returns
    ``[BM, CH, R]``."""
    top = tl.max(s, axis=2, keep_dims=True)
    inv = (0x7F000000 - (top.to(tl.int32, bitcast=True) & 0x7F800000)).to(tl.float32, bitcast=True)
    r = s * tl.where(top > 0, inv, 1.0)
    return r * r


@triton.jit
def _next_tile(pid_m, pid_k, n_k):
    """The tile after ``(pid_m, pid_k)`` in a program's loop (along K, then M; ``n_k`` tiles per
    row of tiles): an increment, where ``t // n_k`` and ``t % n_k`` cost an integer division
    (about 30 instructions per tile, 2 per element of a one-warp tile, in the sm_90 build)."""
    wrap = pid_k + 1 == n_k
    return tl.where(wrap, pid_m + 1, pid_m), tl.where(wrap, 0, pid_k + 1)


@triton.jit
def _group_index(pid_m, pid_k, BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr):
    """Row ``gm`` and 16-group ``g = k / 16`` of each ``[BM, CH, R]`` entry of a tile (int32),
    broadcastable: the group-level :func:`_tile_index`."""
    gm = pid_m * BM + tl.arange(0, BM)[:, None, None]
    g = pid_k * (CH * R) + tl.arange(0, CH)[None, :, None] * R + tl.arange(0, R)[None, None, :]
    return gm, g


@triton.jit
def _tile_index(pid_m, pid_k, BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr,
                N: tl.constexpr = 16):
    """Row ``m`` ``[BM,1,1,1]`` and reduction index ``k`` ``[1,CH,R,N]`` of a tile (int32): the
    first ``N`` elements of each 16-group (all 16, or the lower half of :func:`_load_groups`)."""
    m = pid_m * BM + tl.arange(0, BM)[:, None, None, None]
    k = (pid_k * (CH * R * 16) + tl.arange(0, CH)[None, :, None, None] * (R * 16)
         + tl.arange(0, R)[None, None, :, None] * 16 + tl.arange(0, N)[None, None, None, :])
    return m, k


@triton.jit
def _load_tile_cols(x_ptr, xs_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C,
                    SRC: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The fp32 tile ``A[m, k]`` (``[BM, BK]``) of an operand read across memory rows
    (``A = Xᵀ`` or a transposed packed tensor): loaded in memory order as ``[BK, BM]`` (coalesced
    along m) and transposed on chip, so no transposed copy of ``X`` is ever made."""
    kk = pid_k * BK + tl.arange(0, BK)[:, None]
    if SRC == 0:
        mm = pid_m * BM + tl.arange(0, BM)[None, :]
        xt = tl.load(x_ptr + kk * stride_k + mm * stride_m, mask=(kk < K) & (mm < M),
                     other=0.0).to(tl.float32)
    else:
        # Packed P (R × C, codes along C): A = Pᵀ, so k runs over P's rows and m over C.
        bb = pid_m * (BM // 2) + tl.arange(0, BM // 2)[None, :]
        byte = tl.load(x_ptr + kk * (P_C // 2) + bb, mask=(kk < K) & (bb < M // 2), other=0).to(tl.int32)
        q = _e2m1_value(_byte_codes(byte, (BK, BM)))
        gg = pid_m * (BM // 16) + tl.arange(0, BM // 16)[None, :]
        s = _packed_scales(xs_ptr, kk, gg, (kk < K) & (gg < M // 16), P_C, SRC)
        s = tl.reshape(tl.broadcast_to(tl.expand_dims(s, 2), (BK, BM // 16, 16)), (BK, BM))
        xt = q * s
    return tl.trans(xt)


@triton.jit
def _sign_masks(signs_ptr, ROT: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
                R: tl.constexpr):
    """The sign bits ``0x80000000`` where the Hadamard sign ``σ`` (int8 ±1) of a tile's column is
    −1, at the tile's shape (the same for every tile, so a program loads them once; 0 without a
    rotation): ``x · σ`` is then one XOR per element, exact as the reference's multiply. The
    int8 signs are loaded at the tile's full shape (each row and chunk reads the same h signs):
    a thread then holds 16 consecutive signs, and triton lays the whole rotation out with each
    16-group in one thread's registers, so only the butterfly stages across groups shuffle
    between lanes."""
    sgm = 0
    if ROT > 0:
        m, k = _tile_index(0, 0, BM, CH, R)
        sgm = tl.load(signs_ptr + (m - m) + (k % (16 * R))).to(tl.int32) & -2147483648
    return sgm


@triton.jit
def _load_tile(x_ptr, sgm, xs_ptr, scale_ptr, pid_m, pid_k, m, k, M, K, stride_m, stride_k,
               P_C, SRC: tl.constexpr, COLS: tl.constexpr, HAS_SCALE: tl.constexpr,
               ROT: tl.constexpr, INV_SQRT: tl.constexpr, EVEN: tl.constexpr,
               GROUPS: tl.constexpr,
               BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr,
               SPLIT: tl.constexpr, PRE: tl.constexpr = False, lo=0, hi=0):
    """The fp32 tile ``A[m, k]`` (``[BM, CH, R, 16]``) as the reference sees it: ``src.dense()``,
    then rotated (``(x ⊙ σ) · H / √h``, h = 16·R; ``sgm``: σ's :func:`_sign_masks`) when
    ROT > 0. Masked elements are 0.

    SRC 0: dense, ``A[m, k] = x[m·stride_m + k·stride_k]`` (offsets < 2^31, checked by the
    launcher). SRC 1 / 2: packed NVFP4 1×16 / 16×16 with physical shape ``(R, C)``
    (``C = P_C``), ``A = P`` (or ``A = Pᵀ`` with COLS); the value is ``q · s_block`` (exact), as
    ``NVFP4Tensor.scaled_values``. COLS: ``A`` is read across memory rows (``A = Xᵀ`` or
    ``A = Pᵀ``): by slices with GROUPS (:func:`_load_groups_cols`, which SPLIT passes on),
    else transposed on chip (:func:`_load_tile_cols`). PRE: a dense row tile whose halves
    ``lo`` and ``hi`` are already loaded (:func:`_load_halves`).
    """
    if COLS and GROUPS:
        x = _load_groups_cols(x_ptr, xs_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C, SRC,
                              EVEN, BM, CH, R, SPLIT)
    elif COLS:
        x = tl.reshape(_load_tile_cols(x_ptr, xs_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C,
                                       SRC, BM, CH * R * 16), (BM, CH, R, 16))
    else:
        mask = ((m < M) & (k < K)) | EVEN
        if PRE:
            x = _join_halves(lo, hi, BM, CH, R)
        elif SRC == 0 and GROUPS:
            x = _load_groups(x_ptr, pid_m, pid_k, M, K, stride_m, stride_k, EVEN, BM, CH, R)
        elif SRC == 0:
            x = tl.load(x_ptr + m * stride_m + k * stride_k, mask=mask, other=0.0).to(tl.float32)
        else:
            byte = tl.load(x_ptr + m * (P_C // 2) + k // 2, mask=mask, other=0).to(tl.int32)
            q = _e2m1_value((byte >> ((k % 2) * 4)) & 15)
            x = q * _packed_scales(xs_ptr, m, k // 16, mask, P_C, SRC)
    if HAS_SCALE:
        x = x * tl.load(scale_ptr)
    if ROT > 0:
        x = (x.to(tl.int32, bitcast=True) ^ sgm).to(tl.float32, bitcast=True)
        x = _fwht(x, BM, CH, R, LOG_R) * INV_SQRT
    return x


@triton.jit
def _load_halves(ptr, pid_m, pid_k, M, K, stride_m, stride_k, live, EVEN: tl.constexpr,
                 BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr):
    """The two halves ``[BM, CH, R, 8]`` of each 16-group of a dense row tile, as stored (not
    converted), for :func:`_join_halves`; ``live`` (a scalar) masks the whole tile."""
    m, k = _tile_index(pid_m, pid_k, BM, CH, R, 8)
    mask = (((m < M) & (k < K)) | EVEN) & live  # live: a scalar predicate, no per-element mask
    lo = tl.load(ptr + m * stride_m + k * stride_k, mask=mask, other=0.0)
    hi = tl.load(ptr + m * stride_m + (k + 8) * stride_k, mask=mask, other=0.0)
    return lo, hi


@triton.jit
def _join_halves(lo, hi, BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr):
    """The FP32 tile ``[BM, CH, R, 16]`` of :func:`_load_halves`' halves, each 16-group in one
    thread's registers."""
    x = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 2, 4, 3)), (BM, CH, R, 16))
    return x.to(tl.float32)


@triton.jit
def _load_groups(ptr, pid_m, pid_k, M, K, stride_m, stride_k, EVEN: tl.constexpr,
                 BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr):
    """The FP32 tile ``[BM, CH, R, 16]`` of a dense operand read along its rows, loaded as the
    two halves of each 16-group and joined in registers, so that each thread holds whole groups
    (:func:`_store_groups`)."""
    lo, hi = _load_halves(ptr, pid_m, pid_k, M, K, stride_m, stride_k, True, EVEN, BM, CH, R)
    return _join_halves(lo, hi, BM, CH, R)


@triton.jit
def _col_slice(x_ptr, xs_ptr, pid_m, k, M, K, stride_m, stride_k, P_C, SRC: tl.constexpr,
               EVEN: tl.constexpr, BM: tl.constexpr):
    """FP32 ``A[m, k]`` (``[BM, CH, R]``) for the tile's rows ``m`` and the reduction indices
    ``k`` (``[1, CH, R]``) of an operand read across memory rows: dense (``A = Xᵀ`` through
    strides) or packed (``A = Pᵀ``: k runs over the packed tensor's rows and m over its codes;
    each thread loads whole bytes, i.e. pairs of m, and decodes both codes, ``q · s_block``
    exact). Masked elements are 0."""
    if SRC == 0:
        m = pid_m * BM + tl.arange(0, BM)[:, None, None]
        mask = ((m < M) & (k < K)) | EVEN
        v = tl.load(x_ptr + m * stride_m + k * stride_k, mask=mask, other=0.0).to(tl.float32)
    else:
        mb = pid_m * (BM // 2) + tl.arange(0, BM // 2)[:, None, None]  # bytes: m = 2·mb, 2·mb + 1
        mask = ((mb < M // 2) & (k < K)) | EVEN
        byte = tl.load(x_ptr + k * (P_C // 2) + mb, mask=mask, other=0).to(tl.int32)
        s = _packed_scales(xs_ptr, k, mb // 8, mask, P_C, SRC)
        # q · s = (q · 2^-6) · (s · 2^6), both factors exact (:func:`_e2m1_as_e4m3`)
        q = _e4m3_value(tl.join(_e2m1_as_e4m3(byte & 15), _e2m1_as_e4m3(byte >> 4)))
        v = q * tl.expand_dims(s * 64.0, 3)
        v = tl.reshape(tl.permute(v, (0, 3, 1, 2)), (BM, k.shape[1], k.shape[2]))
    return v


@triton.jit
def _col_quad(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC: tl.constexpr,
              EVEN: tl.constexpr, BM: tl.constexpr, J: tl.constexpr):
    """``[..., 2, 2]`` whose entry ``(b3, b2)`` is the column slice ``A[m, kb + J + 8·b3 + 4·b2]``
    (:func:`_load_groups_cols`)."""
    a = tl.join(_col_slice(x_ptr, xs_ptr, pid_m, kb + J, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM),
                _col_slice(x_ptr, xs_ptr, pid_m, kb + (J + 8), M, K, stride_m, stride_k, P_C, SRC,
                           EVEN, BM))
    b = tl.join(_col_slice(x_ptr, xs_ptr, pid_m, kb + (J + 4), M, K, stride_m, stride_k, P_C, SRC,
                           EVEN, BM),
                _col_slice(x_ptr, xs_ptr, pid_m, kb + (J + 12), M, K, stride_m, stride_k, P_C, SRC,
                           EVEN, BM))
    return tl.join(a, b)


@triton.jit
def _col_groups(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC: tl.constexpr,
                EVEN: tl.constexpr, BM: tl.constexpr):
    """The 16-groups starting at the reduction indices ``kb`` (``[1, CH, G]``) as a tile
    ``[BM, CH, G, 16]`` of whole groups per thread: the 16 slices ``A[m, kb + j]``, joined as
    ``((j, j+8), (j+4, j+12))`` for ``j = 0, 2`` and ``1, 3``, so that the tile's last axes are the
    bits of j from the highest and the reshape is the identity on each thread's registers."""
    lo = tl.join(_col_quad(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM, 0),
                 _col_quad(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM, 2))
    hi = tl.join(_col_quad(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM, 1),
                 _col_quad(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM, 3))
    return tl.reshape(tl.join(lo, hi), (BM, kb.shape[1], kb.shape[2], 16))


@triton.jit
def _load_groups_cols(x_ptr, xs_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C,
                      SRC: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
                      R: tl.constexpr, SPLIT: tl.constexpr):
    """The FP32 tile ``[BM, CH, R, 16]`` of an operand read across memory rows, with each
    16-group in one thread's registers and no on-chip transpose: the 16 elements ``j`` of the
    groups are 16 slices ``[BM, CH, R]``, each loaded along memory rows (``m``, coalesced), and
    joined in registers (``tl.join`` adds its new axis within each thread;
    :func:`_col_groups`). With SPLIT, for dense sources with R ≥ 2, the chunk's groups ``r``
    and ``r + R/2`` are loaded as two halves and joined too, so that a thread holds two groups
    of one row rather than groups of two rows: fewer lanes share a chunk, and its butterfly
    stages and sums exchange less. H200, triton 3.6, 16384×4096 columns, 2026-11, split against
    not: post hoc MS-EDEN 59.5 against 63.2 SASS instructions per element, RHT32+SR 255.0 against
    274.1 µs, SR 231.4 against 244.9; but RTN+4/6 291.2 against 269.3 (198 registers instead of
    168), so :func:`_quant_tile` passes no SPLIT for it, and packed sources post hoc MS-EDEN
    278.9 against 215.1 and RHT32+SR 407.8 against 311.1, so they never split. The rest of the
    quantization is the row layout's (:func:`_load_groups`)."""
    HALVES: tl.constexpr = 2 if SPLIT and SRC == 0 and R >= 2 else 1
    kb = (pid_k * (CH * R * 16) + tl.arange(0, CH)[None, :, None] * (R * 16)
          + tl.arange(0, R // HALVES)[None, None, :] * 16)
    x = _col_groups(x_ptr, xs_ptr, pid_m, kb, M, K, stride_m, stride_k, P_C, SRC, EVEN, BM)
    if HALVES == 2:
        x2 = _col_groups(x_ptr, xs_ptr, pid_m, kb + (R // 2) * 16, M, K, stride_m, stride_k, P_C,
                         SRC, EVEN, BM)
        x = tl.reshape(tl.permute(tl.join(x, x2), (0, 1, 4, 2, 3)), (BM, CH, R, 16))
    return x


@triton.jit
def _store_groups(ptr, v, pid_m, pid_k, M, K, EVEN: tl.constexpr, BM: tl.constexpr,
                  CH: tl.constexpr, R: tl.constexpr):
    """Store a tile ``[BM, CH, R, 16]`` (row-major ``M × K`` at ``ptr``) as the two halves of
    each 16-group, one 8-element vector each: a thread that holds whole groups then stores from
    its own registers (one ``[BM, CH, R, 16]`` store makes triton's coalescing give each thread
    8 elements of a different assignment, a shuffle round trip per element)."""
    lo, hi = tl.split(tl.permute(tl.reshape(v, (BM, CH, R, 2, 8)), (0, 1, 2, 4, 3)))
    m, k = _tile_index(pid_m, pid_k, BM, CH, R, 8)
    mask = ((m < M) & (k < K)) | EVEN
    tl.store(ptr + m * K + k, lo, mask=mask)
    tl.store(ptr + m * K + (k + 8), hi, mask=mask)


@triton.jit
def _atomic_max_nonneg(ptr, v):
    """``*ptr = max(*ptr, v)`` for FP32 ``v ≥ 0`` (and ``*ptr ≥ 0``): one relaxed integer
    ``atomic_max`` on the bit patterns, which order as the values do. (triton's FP32
    ``atomic_max`` is two atomics, each behind a GPU-wide memory fence by its default
    acquire-release semantics; the maximum is only read by a later kernel, after the launch
    boundary, so no ordering is needed.)"""
    _atomic_max_bits(ptr, v.to(tl.int32, bitcast=True))


@triton.jit
def _atomic_max_bits(ptr, bits):
    """``*ptr = max(*ptr, bits)`` on the int32 ``bits ≥ 0`` at the FP32 pointer ``ptr``: one
    relaxed integer ``atomic_max`` (:func:`_atomic_max_nonneg`), skipped when the value there
    (read from L2) is already at least ``bits``. The value only grows, so an outdated read can
    only cost an atomic, never skip a needed one; atomics on one address serialise, and with
    one-tile programs (65536 at 16384×4096) two per program cost 26 µs more than one."""
    ptr = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if bits > tl.load(ptr, cache_modifier=".cg"):
        tl.atomic_max(ptr, bits, sem="relaxed")


@triton.jit
def amax_kernel(x_ptr, xs_ptr, scale_ptr, signs_ptr, amax_ptr, M, K, stride_m, stride_k, P_C,
                SRC: tl.constexpr, COLS: tl.constexpr, HAS_SCALE: tl.constexpr,
                ROT: tl.constexpr, INV_SQRT: tl.constexpr, EVEN: tl.constexpr,
                GROUPS: tl.constexpr, TILES: tl.constexpr,
                BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr):
    """``amax_ptr[0] = max(amax_ptr[0], max |A|)`` over this program's tiles (amax_ptr starts
    at 0; TILES consecutive tiles per program as :func:`quant_kernel`; NaN when a tile holds
    NaN, by the maximum of bit patterns, :func:`_abs_bits`). The rotation's ``1/√h``
    multiplies the maximum instead of every element: rounding is monotone, so
    ``max |RN(y/√h)| = RN(max |y| / √h)``."""
    sgm = _sign_masks(signs_ptr, ROT, BM, CH, R)
    if TILES > 1:
        n_k = tl.cdiv(K, CH * R * 16)
        first = tl.program_id(0) * TILES
        amax = 0
        pm = first // n_k
        pk = first % n_k
        for t in tl.range(first, tl.minimum(first + TILES, tl.cdiv(M, BM) * n_k)):
            amax = tl.maximum(amax, _tile_absmax(
                x_ptr, sgm, xs_ptr, scale_ptr, pm, pk, M, K, stride_m, stride_k, P_C,
                SRC, COLS, HAS_SCALE, ROT, EVEN, GROUPS, BM, CH, R, LOG_R))
            pm, pk = _next_tile(pm, pk, n_k)
    else:
        amax = _tile_absmax(x_ptr, sgm, xs_ptr, scale_ptr, tl.program_id(0), tl.program_id(1), M,
                            K, stride_m, stride_k, P_C, SRC, COLS, HAS_SCALE, ROT, EVEN, GROUPS, BM,
                            CH, R, LOG_R)
    _atomic_max_nonneg(amax_ptr, amax.to(tl.float32, bitcast=True) * INV_SQRT)


@triton.jit
def _tile_absmax(x_ptr, sgm, xs_ptr, scale_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C,
                 SRC: tl.constexpr, COLS: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ROT: tl.constexpr, EVEN: tl.constexpr, GROUPS: tl.constexpr,
                 BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr):
    """``max |A_tile|`` of one tile, rotated without the ``1/√h`` (:func:`amax_kernel`), as its
    int32 bit pattern (:func:`_abs_bits`: NaN kept)."""
    m, k = _tile_index(pid_m, pid_k, BM, CH, R)
    x = _load_tile(x_ptr, sgm, xs_ptr, scale_ptr, pid_m, pid_k, m, k, M, K, stride_m,
                   stride_k, P_C, SRC, COLS, HAS_SCALE, ROT, 1.0, EVEN, GROUPS, BM, CH, R, LOG_R,
                   True)
    return tl.max(tl.max(tl.max(tl.max(_abs_bits(x), axis=3), axis=2), axis=1), axis=0)


@triton.jit
def _round_e2m1(v, u, MODE: tl.constexpr):
    """E2M1 rounding of the scaled values: stochastic with uniforms ``u`` (MODE 1), else nearest
    (:func:`_rtn_e2m1`'s M from the bit pattern under RTN, by compares under MS-EDEN)."""
    if MODE == 1:
        r = _sr_e2m1(v, u)
    else:
        r = _rtn_e2m1(v, MODE == 0)
    return r


@triton.jit
def _group_scales(v, TILE2D: tl.constexpr):
    """Per scale group of a ``[BM, CH, R, 16]`` tile: over the 16 (1×16, ``[BM, CH, R]``) or over
    the 16×16 tile (``TILE2D``: BM = 16, ``[1, CH, R]``) — here the max.

    A float max, which drops NaN (the GPU's max instruction returns the other operand), suffices
    for the non-finite rule of ``quant.quantizers``: with a tensor scale, a NaN or ±inf in the
    tensor makes the amax and so the scale NaN whatever the groups' maxima (:func:`amax_kernel`
    keeps NaN); post hoc MS-EDEN always rotates, and the Hadamard transform makes every element
    of a chunk with a NaN or ±inf input non-finite, so each of its groups has a non-finite max.
    (Its abs then stays an operand modifier of the max instruction: the bit-pattern maximum,
    :func:`_abs_bits`, made RTN + 4/6 of 16384×4096 rows 4% slower on an H200 (2026-11),
    198.7 against 190.5 µs.)"""
    g = tl.max(v, axis=3)
    if TILE2D:
        g = tl.expand_dims(tl.max(g, axis=0), 0)
    return g


@triton.jit
def _candidate(x, xf, f, s, s_t, u, MODE: tl.constexpr, TILE2D: tl.constexpr,
               BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr):
    """The elements ``q`` (values, codes) of the candidate block scales ``s`` and, per scale
    group, their error ``tree_sum((q · s · s_t − x)²)`` (``_quantize_groups``; a 16×16 tile is
    summed in its row-major order: rows, then columns). ``xf = x · f``: :func:`_div_groups`."""
    se = tl.expand_dims(s, 3)
    q, code = _round_e2m1(_div_groups(xf, s * s_t, f), u, MODE)
    d = q * se * s_t - x
    d = d * d
    if TILE2D:
        for lvl in tl.static_range(4):
            d = _halve_sum(d, 0, (2, 8 >> lvl, CH, R, 16))
        err = tl.expand_dims(tl.reshape(_tree_sum_last(tl.reshape(d, (CH, R, 16)), CH, R, 16, 4), (CH, R)), 0)
    else:
        err = tl.reshape(_tree_sum_last(tl.reshape(d, (BM * CH, R, 16)), BM * CH, R, 16, 4), (BM, CH, R))
    return q, code, err


@triton.jit
def quant_kernel(x_ptr, xs_ptr, scale_ptr, signs_ptr, amax_ptr, u_ptr, seed_ptr,
                 val_ptr, code_ptr, sc_ptr, st_ptr, c_ptr,
                 M, K, stride_m, stride_k, P_C, stream,
                 T_TENSOR: tl.constexpr, T_BLOCK: tl.constexpr,
                 SRC: tl.constexpr, COLS: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ROT: tl.constexpr, INV_SQRT: tl.constexpr,
                 MODE: tl.constexpr, FOUR_SIX: tl.constexpr, TILE2D: tl.constexpr,
                 RAND: tl.constexpr, WRITE_VALUES: tl.constexpr, PACK: tl.constexpr,
                 POSTHOC: tl.constexpr, ENERGY: tl.constexpr, EVEN: tl.constexpr,
                 GROUPS: tl.constexpr, TILES: tl.constexpr, PREFETCH: tl.constexpr,
                 SHARED_U: tl.constexpr,
                 BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr):
    """Quantize one tile of ``A`` along K (see the module docstring).

    The tile is ``[BM, CH, R, 16]``: BM rows, and ``BK = CH·R·16`` columns as CH chunks of
    ``h = 16·R`` (the rotation size; without rotation CH = 1) of R groups of 16. Per-group
    quantities are ``[BM, CH, R]`` and broadcast back with ``expand_dims``. GROUPS (the launcher's
    ``whole_groups``: SR, 4/6, rotations, MS-EDEN) keeps each 16-group in one thread's registers
    (loaded by :func:`_load_groups`, or :func:`_load_groups_cols` with COLS; stored by
    :func:`_store_groups`). TILES > 1: each program quantizes that many consecutive tiles in a
    loop; with PREFETCH (dense rows by whole groups, the launcher's ``_prefetches``) it issues
    the next tile's loads (:func:`_load_halves`) before quantizing the current one, so that their
    latency hides behind the work instead of behind other warps; with SHARED_U (MS-EDEN, four
    tiles of one block of 32 groups, the launcher's ``_shares_draws``) it draws the groups'
    uniforms once for the four tiles (:func:`_eden_draw`).

    Outputs (logical layout, row-major): ``val`` BF16 ``M × K`` (``q · s_block``), ``code`` uint8
    ``M × K/2`` (element 2i in the low nibble), ``sc`` uint8 E4M3 bits ``M × K/16`` (or
    ``M/16 × K/16`` with TILE2D, where BM = 16), ``st`` the FP32 tensor scale.

    POSTHOC (MS-EDEN only): the first pass of post hoc range alignment
    (``quantize_ms_eden(posthoc=True)``): no amax is read; provisional scales
    ``m3(amax_b / v)``; the codes (with PACK), the corrected scales ``c`` and their roundings
    ``sr_m3(c)`` (:func:`_sr_m3`: the tensor scale folded in; FP32, ``2 × M × K/16`` at
    ``c_ptr``) and the values ``q · sr_m3(c)`` are written, ``max(c)`` is ``atomic_max``-ed
    into ``amax_ptr`` and each program stores its least positive c (+inf when none) after both,
    at ``c_ptr + 2·M·K/16`` plus its index in the grid (row-major: the index of its first tile
    over TILES); :func:`eden_align_kernel` then sets the tensor scale, writes the E4M3 scales and
    fixes the values it must.

    ENERGY (MS-EDEN only): step 4's ``S = Σ_g w_g Σ_i x_s,gi² / Σ_g w_g Σ_i x_s,gi q_gi`` with
    ``w_g = (s_g / 2^E)²`` (``quantize_ms_eden(correction="energy")``, docs/spec.md §5;
    :func:`_energy_weights`), ``s_g`` the group's block scale (post hoc: ``s_p``); else the
    chunk-scaled ``S = Σ x_s² / Σ x_s q`` of SPEC §2.
    """
    seed = _load_key(seed_ptr, RAND)
    sgm = _sign_masks(signs_ptr, ROT, BM, CH, R)
    if TILES > 1:  # a 1-D grid over groups of TILES tiles
        n_k = tl.cdiv(K, CH * R * 16)
        first = tl.program_id(0) * TILES
        cmax = 0
        cmin = _POS_INF
        last = tl.minimum(first + TILES, tl.cdiv(M, BM) * n_k)
        pm = first // n_k
        pk = first % n_k
        lo = 0
        hi = 0
        u0 = 0.0
        u1 = 0.0
        u2 = 0.0
        u3 = 0.0
        if SHARED_U:  # one Philox call for the program's four tiles (:func:`_eden_draw`)
            gm, g = _group_index(pm, pk, BM, CH, R)
            offset, _ = _eden_draw(gm, g, K)
            r0, r1, r2, r3 = _philox(seed, stream, offset)
            u0, u1 = tl.uint_to_uniform_float(r0), tl.uint_to_uniform_float(r1)
            u2, u3 = tl.uint_to_uniform_float(r2), tl.uint_to_uniform_float(r3)
        if PREFETCH:
            lo, hi = _load_halves(x_ptr, pm, pk, M, K, stride_m, stride_k, first < last, EVEN,
                                  BM, CH, R)
        for t in tl.range(first, last):
            pm_next, pk_next = _next_tile(pm, pk, n_k)
            lo_next = lo
            hi_next = hi
            if PREFETCH:  # the next tile's loads are in flight while this one is quantized
                lo_next, hi_next = _load_halves(x_ptr, pm_next, pk_next, M, K, stride_m, stride_k,
                                                t + 1 < last, EVEN, BM, CH, R)
            tmax, tmin = _quant_tile(
                x_ptr, xs_ptr, scale_ptr, sgm, amax_ptr, u_ptr, seed, val_ptr, code_ptr,
                sc_ptr, st_ptr, c_ptr, M, K, stride_m, stride_k, P_C, stream, pm, pk,
                T_TENSOR, T_BLOCK, SRC, COLS, HAS_SCALE, ROT, INV_SQRT, MODE, FOUR_SIX, TILE2D,
                RAND, WRITE_VALUES, PACK, POSTHOC, ENERGY, EVEN, GROUPS, BM, CH, R, LOG_R, PREFETCH,
                lo, hi, SHARED_U, u0)
            u0, u1, u2, u3 = u1, u2, u3, u0
            pm = pm_next
            pk = pk_next
            lo = lo_next
            hi = hi_next
            cmax = tl.maximum(cmax, tmax)
            cmin = tl.minimum(cmin, tmin)
    else:
        cmax, cmin = _quant_tile(
            x_ptr, xs_ptr, scale_ptr, sgm, amax_ptr, u_ptr, seed, val_ptr, code_ptr,
            sc_ptr, st_ptr, c_ptr, M, K, stride_m, stride_k, P_C, stream,
            tl.program_id(0), tl.program_id(1), T_TENSOR, T_BLOCK, SRC, COLS, HAS_SCALE, ROT, INV_SQRT, MODE,
            FOUR_SIX, TILE2D, RAND, WRITE_VALUES, PACK, POSTHOC, ENERGY, EVEN, GROUPS, BM, CH, R,
            LOG_R)
    if POSTHOC:
        # max(c), and the program's least positive c for the align pass, which fixes only the
        # tiles of programs whose minimum needs it. (Per tile, as scalars: carrying per-group
        # maxima across the tiles instead took 94 registers against 72.)
        _atomic_max_bits(amax_ptr, cmax)
        prog = tl.program_id(0)
        if TILES == 1:
            prog = prog * tl.num_programs(1) + tl.program_id(1)
        tl.store(c_ptr + 2 * M * (K // 16) + prog, cmin)


@triton.jit
def _quant_tile(x_ptr, xs_ptr, scale_ptr, sgm, amax_ptr, u_ptr, seed, val_ptr, code_ptr,
                sc_ptr, st_ptr, c_ptr, M, K, stride_m, stride_k, P_C, stream, pid_m, pid_k,
                T_TENSOR: tl.constexpr, T_BLOCK: tl.constexpr,
                SRC: tl.constexpr, COLS: tl.constexpr, HAS_SCALE: tl.constexpr,
                ROT: tl.constexpr, INV_SQRT: tl.constexpr,
                MODE: tl.constexpr, FOUR_SIX: tl.constexpr, TILE2D: tl.constexpr,
                RAND: tl.constexpr, WRITE_VALUES: tl.constexpr, PACK: tl.constexpr,
                POSTHOC: tl.constexpr, ENERGY: tl.constexpr, EVEN: tl.constexpr,
                GROUPS: tl.constexpr,
                BM: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, LOG_R: tl.constexpr,
                PRE: tl.constexpr = False, lo=0, hi=0, U_PRE: tl.constexpr = False, u_pre=0.0):
    """One tile of :func:`quant_kernel`; returns its largest corrected scale, as its bit pattern
    (:func:`_abs_bits`: NaN kept), and its least positive one (POSTHOC; else 0 and +inf).
    ``U_PRE``: MS-EDEN's group draws are ``u_pre``, drawn by the program (its ``SHARED_U``)."""
    cmax = 0
    cmin = _POS_INF
    m, k = _tile_index(pid_m, pid_k, BM, CH, R)
    x = _load_tile(x_ptr, sgm, xs_ptr, scale_ptr, pid_m, pid_k, m, k, M, K, stride_m,
                   stride_k, P_C, SRC, COLS, HAS_SCALE, ROT, INV_SQRT, EVEN, GROUPS, BM, CH, R,
                   LOG_R, not FOUR_SIX, PRE, lo, hi)
    mask = ((m < M) & (k < K)) | EVEN  # EVEN: whole tiles only, no masks

    if POSTHOC:
        s_t = 1.0  # the align pass sets the tensor scale
        raw = tl.math.div_rn(_group_scales(tl.abs(x), TILE2D), T_BLOCK)
    else:
        amax = tl.load(amax_ptr)
        s_t = _tensor_scale(amax, T_TENSOR)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(st_ptr, s_t)
        raw = tl.math.div_rn(tl.math.div_rn(_group_scales(tl.abs(x), TILE2D), T_BLOCK), s_t)

    u = 0.0
    if MODE == 1:
        if RAND == 0:
            u = tl.load(u_ptr + m * K + k, mask=mask, other=0.0)
        else:
            k4 = (pid_k * (CH * R * 4) + tl.arange(0, CH)[None, :, None, None] * (R * 4)
                  + tl.arange(0, R)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])
            u = _philox_uniforms(seed, stream, m * (K // 4) + k4, (BM, CH, R, 16))

    if POSTHOC:
        s_out = tl.where(raw > 0, _round_mantissa3(tl.maximum(raw, 1.1754943508222875e-38)), 1.0)
    else:
        s_out, bits_out = _block_scale(raw)
    if FOUR_SIX:
        # Both candidates' elements, then the one with the smaller error per group.
        tl.static_assert(MODE != 2, "4/6 applies to RTN and SR, not MS-EDEN")
        s4, bits4 = _block_scale(raw * 1.5)
        # One prescaling of x for both divisions (by the smaller divisor's factor).
        f = _tiny_factor(tl.minimum(s_out, s4) * s_t)
        xf = x * tl.expand_dims(f, 3)
        q6, code6, err6 = _candidate(x, xf, f, s_out, s_t, u, MODE, TILE2D, BM, CH, R)
        q4, code4, err4 = _candidate(x, xf, f, s4, s_t, u, MODE, TILE2D, BM, CH, R)
        use4 = err4 < err6
        s_out = tl.where(use4, s4, s_out)
        bits_out = tl.where(use4, bits4, bits_out)
        q = tl.where(tl.expand_dims(use4, 3), q4, q6)
        code = tl.where(tl.expand_dims(use4, 3), code4, code6)
    else:
        d = s_out * s_t  # post hoc: s_t = 1, exact
        f = _tiny_factor(d)
        x_s = _div_groups(x * tl.expand_dims(f, 3), d, f)
        q, code = _round_e2m1(x_s, u, MODE)
    if PACK:
        # Two codes per byte, element 2i in the low nibble: a sum over each pair (exact ints).
        # Stored at once, so that the rounding's predicates are not kept alive across the
        # EDEN sums.
        shift = tl.where(tl.arange(0, 2) == 0, 1, 16)[None, None, None, None, :]
        packed = tl.sum(tl.reshape(code, (BM, CH, R, 8, 2)) * shift, axis=4).to(tl.uint8)
        mh = pid_m * BM + tl.arange(0, BM)[:, None, None, None]
        kh = (pid_k * (CH * R * 8) + tl.arange(0, CH)[None, :, None, None] * (R * 8)
              + tl.arange(0, R)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :])
        tl.store(code_ptr + mh * (K // 2) + kh, packed, mask=((mh < M) & (kh < K // 2)) | EVEN)

    gm, g = _group_index(pid_m, pid_k, BM, CH, R)
    gmask = ((gm < M) & (g < K // 16)) | EVEN
    if MODE == 2:
        # EDEN correction per rotation chunk (SPEC §2, MS-EDEN steps 4–5; ENERGY: S with each
        # group weighted by its block scale squared, docs/spec.md §5)
        w = 1.0
        if ENERGY:
            w = _energy_weights(s_out)
        num = _chunk_sum(x_s * x_s, w, ENERGY, BM, CH, R, LOG_R)
        den = _chunk_sum(x_s * q, w, ENERGY, BM, CH, R, LOG_R)
        S = tl.where(den != 0, tl.math.div_rn(num, tl.where(den != 0, den, 1.0)), 1.0)
        c = s_out * S
        if POSTHOC:
            # 0 for an all-zero group; NaN for a group holding NaN or ±inf (its x_s holds NaN)
            c = tl.where(raw == 0, 0.0, c)
            cmax = tl.max(tl.max(tl.max(_abs_bits(c), axis=2), axis=1), axis=0)
            cmin = tl.min(tl.min(tl.min(tl.where(c > 0, c, _POS_INF), axis=2), axis=1), axis=0)
            # sr(c / s_t) · s_t, wherever the align pass finds it exact; the align pass reads it
            # back instead of drawing again
            ug = u_pre
            if not U_PRE:
                ug = _group_uniforms(u_ptr, seed, stream, gm, g, gmask, K, RAND)
            s_out = _sr_m3(c, ug)
            # A positive c that sr_m3 rounds to 0 (c < 2^-126) gets 2^-126 instead, so that the
            # align pass, which rewrites such groups, reads q back off the values as
            # ``val / s_out``; the codes are then written only for the packed form.
            s_out = tl.where((s_out == 0) & (c > 0), 1.1754943508222875e-38, s_out)
            tl.store(c_ptr + gm * (K // 16) + g, c, mask=gmask)
            tl.store(c_ptr + M * (K // 16) + gm * (K // 16) + g, s_out, mask=gmask)
        else:
            ug = u_pre
            if not U_PRE:
                ug = _group_uniforms(u_ptr, seed, stream, gm, g, gmask, K, RAND)
            s_out, bits_out = _sr_e4m3(c, ug)

    if WRITE_VALUES:
        val = (q * tl.expand_dims(s_out, 3)).to(tl.bfloat16)
        if GROUPS:
            _store_groups(val_ptr, val, pid_m, pid_k, M, K, EVEN, BM, CH, R)
        else:
            tl.store(val_ptr + m * K + k, val, mask=mask)
    if PACK:
        if TILE2D:
            r16 = pid_m + tl.zeros((1, CH, R), dtype=tl.int32)
            tl.store(sc_ptr + r16 * (K // 16) + g, bits_out, mask=(r16 < M // 16) & (g < K // 16))
        elif not POSTHOC:  # post hoc: the align pass writes the scales
            tl.store(sc_ptr + gm * (K // 16) + g, bits_out, mask=gmask)
    return cmax, cmin


@triton.jit
def eden_align_kernel(c_ptr, cmax_ptr, u_ptr, seed_ptr, val_ptr, sc_ptr, st_ptr, M, K,
                      stream, n_prog, q_tiles, RAND: tl.constexpr, SCALES: tl.constexpr,
                      FIX_VALUES: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr,
                      G: tl.constexpr, V: tl.constexpr, Q_BM: tl.constexpr, Q_G: tl.constexpr,
                      Q_T: tl.constexpr):
    """Second pass of MS-EDEN's post hoc range alignment (``quantize_ms_eden(posthoc=True)``,
    steps 5'–6'): ``s_t`` from ``max(c)`` and, with SCALES, the bits of the stochastic E4M3
    rounding ``s = sr(c / s_t)`` (the same draws as the one-pass kernel), read off the first
    pass's ``sr_m3(c) = s · s_t`` (no draw) except in the rare groups below, which draw again.

    The first pass wrote the values ``q · r`` with ``r = sr_m3(c)`` (:func:`_sr_m3`; 2^-126
    where that is 0 for a positive c). They are ``(q · s) · s_t`` wherever the two roundings use
    the same grid, i.e. unless ``c / s_t < 2^-6`` (below E4M3's normal range: groups about 2^14
    below the tensor's largest) or ``c < 2^-123`` (:func:`_sr_m3`'s least exponent); with
    FIX_VALUES the tiles holding such groups rewrite their values ``(q · s) · s_t``, reading q
    as ``(q · r) / r`` (exact, so the first pass need not write codes for it). (On one grid
    ``down``, ``up`` and ``P(up)`` all scale exactly by ``s_t``, and ``c / s_t ≤ 448`` by the
    choice of ``s_t``.)

    With SCALES, a 1-D grid of programs strides over ``[BM, G]`` tiles of groups, reading 0.25
    bytes per element. Without (the usual case), each program reads V of the first pass's
    per-program minima of the positive c (``n_prog`` of them, after both halves of c): some
    group of a first-pass program needs fixing iff its least positive c does, as ``c / s_t`` is
    monotone in c, and then the program's ``q_tiles`` tiles of ``[Q_BM, Q_G]`` groups (the
    first pass's tiles, in its order: along K, then M) are fixed as one tile (``Q_T``, a power
    of two, at least ``q_tiles``). Per-program minima keep a few far smaller rows (e.g. the
    zero query gradient of a sequence's first token) from sweeping the whole tensor: on an
    H200 (2026-11), 16384×3072 rows with such rows took 99 µs, against 94 without them and 133
    when one tensor-wide minimum decided."""
    s_t = _pow2_scale_448(tl.load(cmax_ptr))
    if tl.program_id(0) == 0:
        tl.store(st_ptr, s_t)
    if SCALES:
        n_g = tl.cdiv(K // 16, G)
        for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * n_g, tl.num_programs(0)):
            gm = (t // n_g) * BM + tl.arange(0, BM)[:, None]
            g = (t % n_g) * G + tl.arange(0, G)[None, :]
            gmask = ((gm < M) & (g < K // 16)) | EVEN
            _align_tile(c_ptr, u_ptr, seed_ptr, val_ptr, sc_ptr, s_t, gm, g, gmask, M,
                        K, stream, RAND, SCALES, FIX_VALUES, BM, G)
    else:
        mins = c_ptr + 2 * M * (K // 16)
        p = tl.program_id(0) * V + tl.arange(0, V)
        cmin = tl.load(mins + p, mask=p < n_prog, other=_POS_INF)
        # a NaN s_t (the input held NaN or ±inf): every program's values become NaN
        fix = tl.where(s_t != s_t, p < n_prog, _needs_fix(cmin, tl.math.div_rn(cmin, s_t)))
        n_k = tl.cdiv(K // 16, Q_G)
        n_tiles = tl.cdiv(M, Q_BM) * n_k
        shape: tl.constexpr = (Q_T, Q_BM, Q_G)
        j = tl.program_id(0) * V - 1
        for _ in tl.range(0, tl.sum(fix.to(tl.int32), axis=0)):  # the programs to fix, in order
            j = tl.min(tl.where(fix & (p > j), p, n_prog), axis=0)
            # its tiles, as one [Q_T·Q_BM, Q_G] tile of groups
            i = tl.arange(0, Q_T)[:, None, None]
            t = j * q_tiles + i
            gm = tl.broadcast_to((t // n_k) * Q_BM + tl.arange(0, Q_BM)[None, :, None], shape)
            g = tl.broadcast_to((t % n_k) * Q_G + tl.arange(0, Q_G)[None, None, :], shape)
            gmask = (i < q_tiles) & (t < n_tiles) & (gm < M) & (g < K // 16)
            _align_tile(c_ptr, u_ptr, seed_ptr, val_ptr, sc_ptr, s_t,
                        tl.reshape(gm, (Q_T * Q_BM, Q_G)), tl.reshape(g, (Q_T * Q_BM, Q_G)),
                        tl.reshape(gmask, (Q_T * Q_BM, Q_G)), M, K, stream, RAND, False,
                        FIX_VALUES, Q_T * Q_BM, Q_G, EAGER=True)


@triton.jit
def _needs_fix(c, c_t):
    """Whether the first pass's rounding of a corrected scale ``c > 0`` (``c_t = c / s_t``) is
    not the align pass's: ``c / s_t`` below E4M3's normal range (2^-6) or ``c`` below
    :func:`_sr_m3`'s least exponent (2^-123)."""
    return (c_t < 0.015625) | (c < 9.4039548065783e-38)


@triton.jit
def _align_tile(c_ptr, u_ptr, seed_ptr, val_ptr, sc_ptr, s_t, gm, g, gmask, M, K,
                stream, RAND: tl.constexpr, SCALES: tl.constexpr, FIX_VALUES: tl.constexpr,
                BM: tl.constexpr, G: tl.constexpr, EAGER: tl.constexpr = False):
    """:func:`eden_align_kernel`'s E4M3 scale bits (SCALES) and fixed values of one tile.
    EAGER (a tile known to hold groups to fix): the key, c and the values are loaded with the
    rounded scales, not after them, so that the loads' latencies overlap. A NaN ``s_t`` (the
    tensor held NaN or ±inf) fixes every group: its values become ``(q · s) · s_t``, NaN."""
    r = tl.load(c_ptr + M * (K // 16) + gm * (K // 16) + g, mask=gmask, other=0.0)
    gm3 = tl.expand_dims(gm, 2)
    k = tl.expand_dims(g, 2) * 16 + tl.arange(0, 16)[None, None, :]
    if EAGER:
        seed = _load_key(seed_ptr, RAND)
        c = tl.load(c_ptr + gm * (K // 16) + g, mask=gmask, other=0.0)
        if FIX_VALUES:
            old = tl.load(val_ptr + gm3 * K + k, mask=tl.expand_dims(gmask, 2), other=0.0)
    bits = _e4m3_bits(tl.math.div_rn(r, s_t))  # exact: r / s_t is on E4M3's grid, at most 448
    # A superset of the groups to fix (``r = sr_m3(c)`` is monotone in c, and 2^-6 · s_t and
    # 2^-123 lie on c's grid, so c below either gives r at most it); their c decides.
    nan_t = s_t != s_t
    maybe = ((r <= 0.015625 * s_t) | (r <= 9.4039548065783e-38)) & gmask  # 2^-6, 2^-123
    maybe = tl.where(nan_t, gmask, maybe)
    if tl.max(tl.max(maybe.to(tl.int32), axis=1), axis=0) > 0:
        if not EAGER:
            seed = _load_key(seed_ptr, RAND)
            c = tl.load(c_ptr + gm * (K // 16) + g, mask=maybe, other=0.0)
        c_t = tl.math.div_rn(c, s_t)
        fix = tl.where(nan_t, maybe, maybe & (c > 0) & _needs_fix(c, c_t))
        s, fix_bits = _sr_e4m3(c_t, _group_uniforms(u_ptr, seed, stream, gm, g, fix, K, RAND))
        bits = tl.where(fix, fix_bits, bits)
        if FIX_VALUES:
            fix3 = tl.expand_dims(fix, 2)
            # q is the first pass's value over its scale r (positive in every group to fix
            # but under a NaN s_t, which makes v NaN anyway), exactly: q · r has at most 6
            # significant bits and is at least 2^-127, so it was stored exactly in BF16
            if not EAGER:
                old = tl.load(val_ptr + gm3 * K + k, mask=fix3, other=0.0)
            q = tl.math.div_rn(old.to(tl.float32), tl.expand_dims(tl.where(fix, r, 1.0), 2))
            v = (q * tl.expand_dims(s, 2)) * s_t
            tl.store(val_ptr + gm3 * K + k, v.to(tl.bfloat16), mask=fix3)
    if SCALES:
        tl.store(sc_ptr + gm * (K // 16) + g, bits, mask=gmask)


@triton.jit
def unpack_kernel(x_ptr, xs_ptr, val_ptr, NR, NC, SRC: tl.constexpr, BM: tl.constexpr,
                  R: tl.constexpr):
    """BF16 ``q · s_block`` of a packed ``NR × NC`` tensor (``NVFP4Tensor.scaled_values``)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m, k = _tile_index(pid_m, pid_k, BM, 1, R)
    x = _load_tile(x_ptr, 0, xs_ptr, x_ptr, pid_m, pid_k, m, k, NR, NC, 0, 0, NC,
                   SRC, False, False, 0, 1.0, False, False, BM, 1, R, 0, False)
    tl.store(val_ptr + m * NC + k, x.to(tl.bfloat16), mask=(m < NR) & (k < NC))


@triton.jit
def _philox(seed, stream, offset):
    """The four uint32 outputs of ``philox(seed, (offset, stream, 0, 0))`` (module docstring)."""
    zero = offset * 0
    return tl.philox(seed, offset, zero + stream, zero, zero)


@triton.jit
def _philox_uniforms(seed, stream, offset4, SHAPE: tl.constexpr):
    """Uniforms of shape ``SHAPE`` (last dim a multiple of 4) for flat indices ``i``:
    ``u[i] = P(i // 4)[i % 4]``, given ``offset4 = i // 4`` with the last dim divided by 4 (one
    Philox call yields four draws)."""
    r0, r1, r2, r3 = _philox(seed, stream, offset4)
    u0, u1 = tl.uint_to_uniform_float(r0), tl.uint_to_uniform_float(r1)
    u2, u3 = tl.uint_to_uniform_float(r2), tl.uint_to_uniform_float(r3)
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), SHAPE)


@triton.jit
def rand_kernel(seed_ptr, out_ptr, N, G, stream, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """The seeded kernels' draws for flat offsets ``i < N`` (module docstring): KIND 0, SR's
    element uniforms ``P(i // 4)[i % 4]``; 1, MS-EDEN's group uniforms of row ``i // G``, group
    ``i % G`` (G groups per row); 2, the Hadamard signs ``±1`` (int8) from the parity of
    ``P(i)[0]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr)
    if KIND == 0:
        u = _philox_uniforms(seed, stream, tl.program_id(0) * (BLOCK // 4) + tl.arange(0, BLOCK // 4), (BLOCK,))
    elif KIND == 1:
        # (RAND 1: the uniforms' pointer, here out_ptr, is not read)
        u = _group_uniforms(out_ptr, seed, stream, offs // G, offs % G, offs < N, G * 16, 1)
    else:
        r0, _r1, _r2, _r3 = _philox(seed, stream, offs)
        u = tl.where((r0 & 1) == 1, 1.0, -1.0)
    tl.store(out_ptr + offs, u.to(out_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def scale_kernel(y_ptr, sa_ptr, sb_ptr, out_ptr, N, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
                 ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """The GEMM epilogue of ``quant.linear._product``: ``out = dtype(y · (s_a · s_b))`` with the
    product and the scales in FP32 (a missing tensor scale counts as 1), rounded once to
    ``dtype`` (ROUND 0: float32, 1: bfloat16, 2: float16), then stored in ``out``'s dtype (the
    layer's input or parameter dtype), in one pass."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0
    if HAS_A:
        s = tl.load(sa_ptr)
    if HAS_B:
        s = s * tl.load(sb_ptr)
    r = y * s
    if ROUND == 1:
        r = r.to(tl.bfloat16)
    elif ROUND == 2:
        r = r.to(tl.float16)
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def transpose_kernel(x_ptr, xs_ptr, out_ptr, M, K, stride_m, stride_k, P_C, SRC: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr):
    """``out = A`` as a contiguous ``M × K`` tensor, for an ``A`` read across memory rows
    (``A = Xᵀ``, or a transposed packed tensor, whose exact ``q · s_block`` values are written):
    one coalesced read, a transpose through shared memory, one coalesced write."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    x = _load_tile_cols(x_ptr, xs_ptr, pid_m, pid_k, M, K, stride_m, stride_k, P_C, SRC, BM, BK)
    m = pid_m * BM + tl.arange(0, BM)[:, None]
    k = pid_k * BK + tl.arange(0, BK)[None, :]
    tl.store(out_ptr + m * K + k, x.to(out_ptr.dtype.element_ty), mask=(m < M) & (k < K))
