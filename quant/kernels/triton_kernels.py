"""Triton kernels of the NVFP4 quantizers (SPEC §2), bit-exact with :mod:`quant.quantizers`.

Every kernel works on a *logical* 2-D operand ``A`` (``M × K``, groups of 16 along ``K``, the GEMM's
reduction dim). ``A`` is read through strides, so ``A = X`` and ``A = Xᵀ`` are the same kernel:
the tile transpose happens in registers/shared memory, never as a ``.t().contiguous()`` copy.
``A`` is either dense (any float dtype, optionally times an FP32 tensor scale) or a packed NVFP4
tensor (two E2M1 codes per byte + E4M3 scales, 1×16 or 16×16), possibly transposed.

Two passes per quantization (the tensor scale depends on the tensor amax, and the tensor does
not fit on chip): :func:`amax_kernel` reads ``A`` (rotating it if asked) and ``atomic_max``-es
``max |A|`` into an FP32 scalar; :func:`quant_kernel` reads ``A`` again and writes the
GEMM-ready values ``q · s_block`` in BF16 and, optionally, the packed storage form.

Bit-exactness rules (the reference is the contract):
* every FP32 division is ``tl.math.div_rn`` (Triton's ``/`` is an approximate division on GPUs);
* launch with ``enable_fp_fusion=False`` so that no multiply–add pair is contracted to an FMA;
* the Hadamard butterfly and the EDEN chunk sums are fixed trees of single additions built from
  reshape / permute / split / join, in the order of :func:`quant.hadamard.fwht` and
  :func:`quant.quantizers.tree_sum`;
* values are clamped to 448 before every E4M3 cast;
* constants are passed already rounded to FP32 (as torch rounds a Python float divisor).

Random draws: explicit uniforms (``RAND=0``, for tests: the layout of the logical operand, one
per element for SR and one per 16-group for MS-EDEN) or Philox (``RAND=1``):
``u = tl.rand(seed, offset)`` with ``offset = m·K + k`` (SR, element (m, k) of ``A``) or
``offset = m·(K/16) + g`` (MS-EDEN, group g of row m). :func:`rand_kernel` materialises
``tl.rand(seed, 0..n-1)``, i.e. exactly the draws the seeded path uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Quantizer modes of quant_kernel.
MODE_RTN = 0
MODE_SR = 1
MODE_EDEN = 2


@triton.jit
def _e4m3_bits(v):
    """uint8 bits of e4m3(v) for v >= 0 (round to nearest even, saturating at 448)."""
    return tl.minimum(v, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _e4m3_value(bits):
    return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _block_scale(raw):
    """``e4m3_block_scale``: e4m3(raw) with 0 replaced by 1. Returns (fp32 value, uint8 bits)."""
    bits = _e4m3_bits(raw)
    bits = tl.where(bits == 0, 0x38, bits).to(tl.uint8)
    return _e4m3_value(bits), bits


@triton.jit
def _e2m1_mag(code):
    """Magnitude of a 3-bit E2M1 code (int32 0..7): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    return tl.where(code < 4, code.to(tl.float32) * 0.5,
                    tl.where(code == 7, 6.0, (code - 2).to(tl.float32)))


@triton.jit
def _rtn_e2m1(v):
    """Nearest-even E2M1 of v (saturating at 6). Returns (signed value fp32, 4-bit code int32)."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    mag = _e2m1_mag(code)
    neg = v < 0
    return tl.where(neg, mag * -1.0, mag), code + tl.where(neg, 8, 0)


@triton.jit
def _sr_e2m1(v, u):
    """Stochastic E2M1 rounding of v with uniform u (``stochastic_round_e2m1``)."""
    a = tl.minimum(tl.abs(v), 6.0)
    lo_i = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
            + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
            + (a >= 6.0).to(tl.int32))
    hi_i = tl.minimum(lo_i + 1, 7)
    lo = _e2m1_mag(lo_i)
    hi = _e2m1_mag(hi_i)
    gap = hi - lo
    p_up = tl.where(gap > 0, tl.math.div_rn(a - lo, tl.where(gap > 0, gap, 1.0)), 0.0)
    up = u < p_up
    mag = tl.where(up, hi, lo)
    code = tl.where(up, hi_i, lo_i)
    neg = v < 0
    return tl.where(neg, mag * -1.0, mag), code + tl.where(neg, 8, 0)


@triton.jit
def _sr_e4m3(c, u):
    """``stochastic_round_e4m3``: c >= 0 to one of its E4M3 neighbours. Returns (value, bits)."""
    c = tl.minimum(c, 448.0)
    bits = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    rf = _e4m3_value(bits.to(tl.uint8))
    below = _e4m3_value(tl.maximum(bits - 1, 0).to(tl.uint8))
    above = _e4m3_value(tl.minimum(bits + 1, 0x7E).to(tl.uint8))
    down = tl.where(rf > c, below, rf)
    up = tl.where(rf < c, above, rf)
    down_bits = tl.where(rf > c, tl.maximum(bits - 1, 0), bits)
    up_bits = tl.where(rf < c, tl.minimum(bits + 1, 0x7E), bits)
    gap = up - down
    p_up = tl.where(gap > 0, tl.math.div_rn(c - down, tl.where(gap > 0, gap, 1.0)), 0.0)
    take_up = u < p_up
    return tl.where(take_up, up, down), tl.where(take_up, up_bits, down_bits).to(tl.uint8)


@triton.jit
def _tree_sum(v, P: tl.constexpr, Q: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """``tree_sum`` over the last dim of a ``[P, Q, N]`` tensor: ``v[:n/2] + v[n/2:]`` repeated.

    Each level views the ``n`` elements as ``[2, n/2]`` and adds the two halves; the reduction
    over an axis of size 2 is a single IEEE addition (commutative, so its operand order does not
    matter), hence the result equals the reference tree bit for bit.
    """
    for s in tl.static_range(LOG_N):
        v = tl.sum(tl.reshape(v, (P, Q, 2, N >> (s + 1))), axis=2)
    return tl.reshape(v, (P, Q))


@triton.jit
def _fwht(x, BM: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, LOG_H: tl.constexpr):
    """``fwht`` (without the 1/√h) on chunks of H along axis 1 of a ``[BM, BK]`` tile.

    Constant-geometry form: each stage maps ``y[j] = x[2j] + x[2j+1]``,
    ``y[j + H/2] = x[2j] − x[2j+1]``. Stage s thus combines the pairs whose original indices
    differ in bit s, with the element of bit 0 as ``a`` — exactly the additions of the
    reference butterfly (span 2^s) — and after log2 H stages the outputs are in natural order.
    """
    for _s in tl.static_range(LOG_H):
        y = tl.reshape(x, (BM, BK // H, H // 2, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BM, BK))
    return x


@triton.jit
def _load_tile(x_ptr, xs_ptr, scale_ptr, signs_ptr, offs_m, offs_k, M, K,
               stride_m, stride_k, P_C,
               SRC: tl.constexpr, PT: tl.constexpr, HAS_SCALE: tl.constexpr,
               ROT: tl.constexpr, LOG_ROT: tl.constexpr, INV_SQRT: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr):
    """The fp32 tile ``A[offs_m, offs_k]`` as the reference sees it: ``src.dense()``, then
    rotated (``(x ⊙ σ) · H / √h``) when ROT > 0. Masked elements are 0.

    SRC 0: dense, ``A[m, k] = x[m·stride_m + k·stride_k]``. SRC 1 / 2: packed NVFP4 1×16 / 16×16
    with physical shape ``(R, C)`` (``C = P_C``), ``A = P`` or ``A = Pᵀ`` (PT); the value is
    ``q · s_block`` (exact), as ``NVFP4Tensor.scaled_values``.
    """
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    if SRC == 0:
        ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_k.to(tl.int64)[None, :] * stride_k
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        if PT:
            r = offs_k[None, :]
            c = offs_m[:, None]
        else:
            r = offs_m[:, None]
            c = offs_k[None, :]
        byte = tl.load(x_ptr + r.to(tl.int64) * (P_C // 2) + c // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((c % 2) * 4)) & 15
        mag = _e2m1_mag(code & 7)
        q = tl.where(code >= 8, mag * -1.0, mag)
        if SRC == 1:
            sptr = xs_ptr + r.to(tl.int64) * (P_C // 16) + c // 16
        else:
            sptr = xs_ptr + (r // 16).to(tl.int64) * (P_C // 16) + c // 16
        sb = _e4m3_value(tl.load(sptr, mask=mask, other=0))
        x = q * sb
    if HAS_SCALE:
        x = x * tl.load(scale_ptr)
    if ROT > 0:
        sg = tl.load(signs_ptr + offs_k % ROT)
        x = x * sg[None, :]
        x = _fwht(x, BM, BK, ROT, LOG_ROT)
        x = x * INV_SQRT
    return x


@triton.jit
def _expand_scale(s, BM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, TILE2D: tl.constexpr):
    """Block scales broadcast to the ``[BM, BK]`` tile: one per 16×16 tile (``TILE2D``, ``s`` is
    ``[BM/16, G]``) or one per 1×16 group (``s`` is ``[BM, G]``)."""
    if TILE2D:
        se = tl.reshape(tl.broadcast_to(tl.reshape(s, (BM // 16, 1, G, 1)), (BM // 16, 16, G, 16)), (BM, BK))
    else:
        se = tl.reshape(tl.broadcast_to(tl.reshape(s, (BM, G, 1)), (BM, G, 16)), (BM, BK))
    return se


@triton.jit
def amax_kernel(x_ptr, xs_ptr, scale_ptr, signs_ptr, amax_ptr, M, K, stride_m, stride_k, P_C,
                SRC: tl.constexpr, PT: tl.constexpr, HAS_SCALE: tl.constexpr,
                ROT: tl.constexpr, LOG_ROT: tl.constexpr, INV_SQRT: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr):
    """``amax_ptr[0] = max(amax_ptr[0], max |A_tile|)`` (amax_ptr starts at 0)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    x = _load_tile(x_ptr, xs_ptr, scale_ptr, signs_ptr, offs_m, offs_k, M, K, stride_m, stride_k,
                   P_C, SRC, PT, HAS_SCALE, ROT, LOG_ROT, INV_SQRT, BM, BK)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def quant_kernel(x_ptr, xs_ptr, scale_ptr, signs_ptr, amax_ptr, u_ptr, seed_ptr,
                 val_ptr, code_ptr, sc_ptr, st_ptr,
                 M, K, stride_m, stride_k, P_C,
                 T_TENSOR: tl.constexpr, T_BLOCK: tl.constexpr,
                 SRC: tl.constexpr, PT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ROT: tl.constexpr, LOG_ROT: tl.constexpr, INV_SQRT: tl.constexpr,
                 MODE: tl.constexpr, FOUR_SIX: tl.constexpr, TILE2D: tl.constexpr,
                 RAND: tl.constexpr, WRITE_VALUES: tl.constexpr, PACK: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr):
    """Quantize one ``[BM, BK]`` tile of ``A`` along K (see the module docstring).

    Outputs (logical layout, row-major): ``val`` BF16 ``M × K`` (``q · s_block``), ``code`` uint8
    ``M × K/2`` (element 2i in the low nibble), ``sc`` uint8 E4M3 bits ``M × K/16`` (or
    ``M/16 × K/16`` with TILE2D), ``st`` the FP32 tensor scale.
    """
    G: tl.constexpr = BK // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    x = _load_tile(x_ptr, xs_ptr, scale_ptr, signs_ptr, offs_m, offs_k, M, K, stride_m, stride_k,
                   P_C, SRC, PT, HAS_SCALE, ROT, LOG_ROT, INV_SQRT, BM, BK)

    amax = tl.load(amax_ptr)
    s_t = tl.where(amax > 0, tl.math.div_rn(amax, T_TENSOR), 1.0)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(st_ptr, s_t)

    # Group amax and the raw block scale amax_b / target / s_t, per scale group.
    if TILE2D:
        x4 = tl.reshape(x, (BM // 16, 16, G, 16))
        amax_b = tl.max(tl.max(tl.abs(x4), axis=3), axis=1)            # [BM/16, G]
    else:
        xg = tl.reshape(x, (BM, G, 16))
        amax_b = tl.max(tl.abs(xg), axis=2)                             # [BM, G]
    raw = tl.math.div_rn(tl.math.div_rn(amax_b, T_BLOCK), s_t)

    if MODE == 1:
        if RAND == 0:
            mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
            u = tl.load(u_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        else:
            u = tl.rand(tl.load(seed_ptr), offs_m[:, None] * K + offs_k[None, :])

    s6, bits6 = _block_scale(raw)
    s6e = _expand_scale(s6, BM, BK, G, TILE2D)
    x_s = tl.math.div_rn(x, s6e * s_t)
    if MODE == 1:
        q, code = _sr_e2m1(x_s, u)
    else:
        q, code = _rtn_e2m1(x_s)
    s_out = s6
    bits_out = bits6

    if FOUR_SIX:
        s4, bits4 = _block_scale(raw * 1.5)
        s4e = _expand_scale(s4, BM, BK, G, TILE2D)
        x_s4 = tl.math.div_rn(x, s4e * s_t)
        if MODE == 1:
            q4, code4 = _sr_e2m1(x_s4, u)
        else:
            q4, code4 = _rtn_e2m1(x_s4)
        d6 = q * s6e * s_t - x
        d4 = q4 * s4e * s_t - x
        if TILE2D:
            e6 = tl.reshape(tl.permute(tl.reshape(d6 * d6, (BM // 16, 16, G, 16)), (0, 2, 1, 3)), (BM // 16, G, 256))
            e4 = tl.reshape(tl.permute(tl.reshape(d4 * d4, (BM // 16, 16, G, 16)), (0, 2, 1, 3)), (BM // 16, G, 256))
            err6 = _tree_sum(e6, BM // 16, G, 256, 8)
            err4 = _tree_sum(e4, BM // 16, G, 256, 8)
            use4 = err4 < err6                                          # [BM/16, G]
            use4e = tl.reshape(tl.broadcast_to(tl.reshape(use4, (BM // 16, 1, G, 1)), (BM // 16, 16, G, 16)), (BM, BK))
        else:
            err6 = _tree_sum(tl.reshape(d6 * d6, (BM, G, 16)), BM, G, 16, 4)
            err4 = _tree_sum(tl.reshape(d4 * d4, (BM, G, 16)), BM, G, 16, 4)
            use4 = err4 < err6                                          # [BM, G]
            use4e = tl.reshape(tl.broadcast_to(tl.reshape(use4, (BM, G, 1)), (BM, G, 16)), (BM, BK))
        q = tl.where(use4e, q4, q)
        code = tl.where(use4e, code4, code)
        s_out = tl.where(use4, s4, s6)
        bits_out = tl.where(use4, bits4, bits6)

    if MODE == 2:
        # EDEN correction per rotation chunk of ROT elements (ROT // 16 groups).
        CH: tl.constexpr = BK // ROT
        num = _tree_sum(tl.reshape(x_s * x_s, (BM, CH, ROT)), BM, CH, ROT, LOG_ROT)
        den = _tree_sum(tl.reshape(x_s * q, (BM, CH, ROT)), BM, CH, ROT, LOG_ROT)
        S = tl.where(den != 0, tl.math.div_rn(num, tl.where(den != 0, den, 1.0)), 1.0)   # [BM, CH]
        Sg = tl.reshape(tl.broadcast_to(tl.reshape(S, (BM, CH, 1)), (BM, CH, ROT // 16)), (BM, G))
        c = s6 * Sg
        offs_g = pid_k * G + tl.arange(0, G)
        if RAND == 0:
            gmask = (offs_m < M)[:, None] & (offs_g < K // 16)[None, :]
            ug = tl.load(u_ptr + offs_m.to(tl.int64)[:, None] * (K // 16) + offs_g[None, :], mask=gmask, other=0.0)
        else:
            ug = tl.rand(tl.load(seed_ptr), offs_m[:, None] * (K // 16) + offs_g[None, :])
        s_out, bits_out = _sr_e4m3(c, ug)

    if WRITE_VALUES:
        se = _expand_scale(s_out, BM, BK, G, TILE2D)
        mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
        vptrs = val_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
        tl.store(vptrs, (q * se).to(tl.bfloat16), mask=mask)
    if PACK:
        lo, hi = tl.split(tl.reshape(code, (BM, BK // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        offs_h = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        pmask = (offs_m < M)[:, None] & (offs_h < K // 2)[None, :]
        tl.store(code_ptr + offs_m.to(tl.int64)[:, None] * (K // 2) + offs_h[None, :], packed, mask=pmask)
        offs_g2 = pid_k * G + tl.arange(0, G)
        if TILE2D:
            offs_r = pid_m * (BM // 16) + tl.arange(0, BM // 16)
            smask = (offs_r < M // 16)[:, None] & (offs_g2 < K // 16)[None, :]
            tl.store(sc_ptr + offs_r[:, None] * (K // 16) + offs_g2[None, :], bits_out, mask=smask)
        else:
            smask = (offs_m < M)[:, None] & (offs_g2 < K // 16)[None, :]
            tl.store(sc_ptr + offs_m.to(tl.int64)[:, None] * (K // 16) + offs_g2[None, :], bits_out, mask=smask)


@triton.jit
def unpack_kernel(x_ptr, xs_ptr, val_ptr, R, C, SRC: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """BF16 ``q · s_block`` of a packed ``R × C`` tensor (``NVFP4Tensor.scaled_values``)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    x = _load_tile(x_ptr, xs_ptr, x_ptr, x_ptr, offs_m, offs_k, R, C, 0, 0, C,
                   SRC, False, False, 0, 0, 1.0, BM, BK)
    mask = (offs_m < R)[:, None] & (offs_k < C)[None, :]
    tl.store(val_ptr + offs_m.to(tl.int64)[:, None] * C + offs_k[None, :], x.to(tl.bfloat16), mask=mask)


@triton.jit
def rand_kernel(seed_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """``out[i] = tl.rand(seed, i)``: the uniforms the seeded quantizers draw (offset i)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.rand(tl.load(seed_ptr), offs), mask=offs < N)
