"""The cuBLAS/torch NVFP4 block-scale layout (quant.native.scale_layout) and the scaled-matmul
simulator (quant.native.scaled_mm_sim), on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from quant.factor import Factor
from quant.format import E2M1_MAX, E4M3_MAX, PackedNVFP4
from quant.linear import _product
from quant.native.scale_layout import (
    native_operands,
    pad_scales,
    padded_shape,
    swizzle_scales,
    unswizzle_scales,
)
from quant.native.scaled_mm_sim import _block_scaled, round_once, simulate_scaled_mm
from quant.quantizers import quantize_rtn, quantize_rtn_2d

SHAPES = [(200, 3), (128, 4), (130, 5), (256, 8), (1, 1), (300, 9)]


def _random_bytes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Non-zero bytes, so that any padding byte (0) is told apart from a real scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.uint8)


def _random_e4m3(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Positive finite E4M3 scales (as block scales are), subnormals included."""
    b = _random_bytes(rows, cols, seed) % 0x7F  # 0x00..0x7E: +0 … 448; make zero a 1
    b = torch.where(b == 0, torch.full_like(b, 0x38), b)
    return b.view(torch.float8_e4m3fn)


def _documented_layout(s: torch.Tensor) -> torch.Tensor:
    """The cuBLAS "1D Block Scaling Factors Layout", element by element: 128×4 tiles stored
    row-major over tiles, tile-local (r, c) at byte (r % 32)·16 + (r // 32)·4 + c; zeros
    everywhere no scale lands (the padding)."""
    rows, cols = s.shape
    rows_p = -(-rows // 128) * 128
    cols_p = -(-cols // 4) * 4
    out = [0] * (rows_p * cols_p)
    vals = s.view(torch.uint8).tolist()
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (cols_p // 4) + c // 4
            rr, cc = r % 128, c % 4
            out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = vals[r][c]
    return torch.tensor(out, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------
# layout


def test_padded_shape() -> None:
    assert padded_shape(200, 3) == (256, 4)  # M = 200, K = 48
    assert padded_shape(128, 4) == (128, 4)
    assert padded_shape(129, 5) == (256, 8)
    assert padded_shape(1, 1) == (128, 4)
    assert padded_shape(0, 0) == (0, 0)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_matches_documented_offsets(rows: int, cols: int) -> None:
    s = _random_bytes(rows, cols, seed=rows * 31 + cols)
    flat = swizzle_scales(s)
    assert flat.dim() == 1 and flat.dtype == torch.uint8
    assert torch.equal(flat, _documented_layout(s))


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_float8_is_the_byte_layout(rows: int, cols: int) -> None:
    s = _random_e4m3(rows, cols, seed=rows + 7 * cols)
    flat = swizzle_scales(s)
    assert flat.dtype == torch.float8_e4m3fn
    assert torch.equal(flat.view(torch.uint8), _documented_layout(s))


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_round_trip(rows: int, cols: int, dtype: torch.dtype) -> None:
    s = _random_e4m3(rows, cols, seed=3 * rows + cols).view(dtype)
    back = unswizzle_scales(swizzle_scales(s), rows, cols)
    assert back.dtype == dtype and back.shape == (rows, cols)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    # and the other way: a flat buffer whose padding is zero survives unswizzle → swizzle
    flat = swizzle_scales(s)
    assert torch.equal(swizzle_scales(unswizzle_scales(flat, rows, cols)).view(torch.uint8),
                       flat.view(torch.uint8))


def test_padding_is_zero() -> None:
    s = _random_e4m3(200, 3, seed=1)  # M = 200, K = 48 → 3 scale columns
    p = pad_scales(s)
    assert p.shape == (256, 4) and p.dtype == torch.float8_e4m3fn
    pb = p.view(torch.uint8)
    assert torch.equal(pb[:200, :3], s.view(torch.uint8))
    assert (pb[200:] == 0).all() and (pb[:, 3:] == 0).all()
    assert (p.float()[200:] == 0).all()  # byte 0 is E4M3 +0
    flat = swizzle_scales(s).view(torch.uint8)
    assert flat.numel() == 256 * 4
    assert int((flat != 0).sum()) == 200 * 3  # every real scale is non-zero, all else padding


def test_bad_inputs_raise_clear_errors() -> None:
    s = _random_e4m3(8, 2, seed=0)
    with pytest.raises(ValueError, match="2-D"):
        swizzle_scales(s.reshape(-1))
    with pytest.raises(ValueError, match="1-byte"):
        swizzle_scales(s.float())
    with pytest.raises(ValueError, match="1-D"):
        unswizzle_scales(swizzle_scales(s).reshape(2, -1), 8, 2)
    with pytest.raises(ValueError, match="512"):
        unswizzle_scales(swizzle_scales(s)[:-1], 8, 2)
    with pytest.raises(ValueError, match="non-negative"):
        padded_shape(-1, 4)
    with pytest.raises(ValueError, match="non-negative"):
        padded_shape(4, 2.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# operands of a native call


def _data(rows: int, k: int, seed: int, pow2_scale: int | None = None) -> torch.Tensor:
    """Random data with row and column magnitudes spread over a few decades (varied block
    scales). With ``pow2_scale = e`` the amax is exactly 6·448·2^e, so RTN's tensor scale
    ``amax / (6·448)`` is the power of two 2^e and dequantization is exact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x * torch.exp(2 * torch.randn(rows, 1, generator=g)) * torch.exp(torch.randn(1, k, generator=g))
    if pow2_scale is not None:
        amax = E2M1_MAX * E4M3_MAX * 2.0**pow2_scale
        x = x / x.abs().max() * (0.99 * amax)
        x[0, 0] = amax
    return x


def _operands(m: int, n: int, k: int, seed: int, pow2: bool = False):
    qa = quantize_rtn(_data(m, k, seed, -9 if pow2 else None))
    qb = quantize_rtn(_data(n, k, seed + 1, 5 if pow2 else None))
    return qa, qb, native_operands(qa.pack(), qb.pack())


def test_native_operands_pad_k_to_64() -> None:
    qa, qb, ops = _operands(200, 72, 48, seed=11)
    pa = qa.pack()
    assert ops.k == 48 and ops.k_padded == 64
    assert ops.a_data.shape == (200, 32) and ops.b_data.shape == (72, 32)
    assert ops.a_data.dtype == torch.uint8
    assert torch.equal(ops.a_data[:, :24], pa.data) and (ops.a_data[:, 24:] == 0).all()
    assert (ops.b_data[:, 24:] == 0).all()
    assert ops.a_scale.dtype == torch.float8_e4m3fn and ops.a_scale.numel() == 256 * 4
    assert ops.b_scale.numel() == 128 * 4
    sa = unswizzle_scales(ops.a_scale, 200, 4).view(torch.uint8)
    assert torch.equal(sa[:, :3], pa.scales.view(torch.uint8)) and (sa[:, 3] == 0).all()
    assert ops.a_tensor_scale.dtype == torch.float32 and ops.a_tensor_scale.dim() == 0
    assert ops.alpha == qa.tensor_scale * qb.tensor_scale


def test_native_operands_no_padding_when_aligned() -> None:
    qa, _, ops = _operands(128, 128, 128, seed=12)
    assert ops.k_padded == 128 and torch.equal(ops.a_data, qa.pack().data)


def test_native_operands_errors() -> None:
    pa = quantize_rtn(_data(32, 64, 1)).pack()
    pb = quantize_rtn(_data(16, 48, 2)).pack()
    with pytest.raises(ValueError, match="reduction dim K"):
        native_operands(pa, pb)
    with pytest.raises(ValueError, match="PackedNVFP4"):
        native_operands(pa, pa.unpack())  # type: ignore[arg-type]
    bad = PackedNVFP4(pa.data, pa.scales.float(), pa.tensor_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        native_operands(bad, pa)
    bad = PackedNVFP4(pa.data.to(torch.int16), pa.scales, pa.tensor_scale)
    with pytest.raises(ValueError, match="uint8"):
        native_operands(pa, bad)
    bad = PackedNVFP4(pa.data[None], pa.scales[None], pa.tensor_scale)
    with pytest.raises(ValueError, match="2-D"):
        native_operands(bad, pa)
    bad = PackedNVFP4(pa.data, pa.scales[:, :2], pa.tensor_scale)
    with pytest.raises(ValueError, match="K/16"):
        native_operands(bad, pa)
    bad = PackedNVFP4(pa.data, pa.scales, pa.tensor_scale.double())
    with pytest.raises(ValueError, match="float32"):
        native_operands(bad, pa)


# --------------------------------------------------------------------------------------------
# simulator

SIM_SHAPES = [(200, 72, 48), (128, 128, 64), (37, 300, 160), (129, 5, 16)]


def test_simulator_decodes_operands_exactly() -> None:
    # The decoded q·s_block of each operand, bit for bit, zero over the K padding. (The nibble
    # order is invisible in A·Bᵀ when both operands share it, as a pair shares one scale: this
    # is what pins it down.)
    qa, qb, ops = _operands(200, 72, 48, seed=21)
    for q, data, scale, rows in ((qa, ops.a_data, ops.a_scale, 200), (qb, ops.b_data, ops.b_scale, 72)):
        v = _block_scaled(data, scale, rows)
        assert v.shape == (rows, 64)
        assert torch.equal(v[:, :48], q.scaled_values()) and (v[:, 48:] == 0).all()


@pytest.mark.parametrize("m,n,k", SIM_SHAPES)
def test_simulator_equals_fp64_dense_reference(m: int, n: int, k: int) -> None:
    # Power-of-two tensor scales: x̂ = q·s_b·s_t is exact in FP32, so the dense FP64 product of
    # the dequantized operands is the exact (to FP64) result; rounded once it must be bitwise
    # what the FP64 simulator returns.
    qa, qb, ops = _operands(m, n, k, seed=m + n + k, pow2=True)
    assert qa.tensor_scale == 2.0**-9 and qb.tensor_scale == 2.0**5
    ref = qa.dequantize().double() @ qb.dequantize().double().T
    sim = simulate_scaled_mm(ops, m, n, compute_dtype=torch.float64)
    assert sim.dtype == torch.bfloat16 and sim.shape == (m, n)
    assert torch.equal(sim, round_once(ref, torch.bfloat16))
    # General (non-power-of-two) tensor scales: the block-scaled product in FP64 times the FP32
    # α, rounded once, is again bitwise the FP64 simulator.
    qa, qb, ops = _operands(m, n, k, seed=2 * (m + n + k))
    alpha = (qa.tensor_scale * qb.tensor_scale).double()
    ref = (qa.scaled_values().double() @ qb.scaled_values().double().T) * alpha
    assert torch.equal(simulate_scaled_mm(ops, m, n, compute_dtype=torch.float64),
                       round_once(ref, torch.bfloat16))
    # and the dequantized reference (FP32-rounded x̂) is within one BF16 ulp of it
    deq = (qa.dequantize().double() @ qb.dequantize().double().T)
    sim = simulate_scaled_mm(ops, m, n).double()
    ulp = torch.finfo(torch.bfloat16).eps * deq.abs()
    scale = (qa.scaled_values().abs().double() @ qb.scaled_values().abs().double().T) * alpha
    assert ((sim - deq).abs() <= ulp + 4 * k * 2.0**-24 * scale).all()


@pytest.mark.parametrize("m,n,k", SIM_SHAPES)
def test_simulator_agrees_with_emulated_product(m: int, n: int, k: int) -> None:
    qa, qb, ops = _operands(m, n, k, seed=3 * (m + n + k))
    emu = _product(Factor.of(qa), Factor.of(qb), torch.float32)
    sim = simulate_scaled_mm(ops, m, n, out_dtype=torch.float32)
    assert sim.dtype == torch.float32
    # Both sum the same exact FP32 terms t_k = (q_A s_A)(q_B s_B) (≤ 10 significant bits) in
    # FP32, in different orders. Any FP32 summation order is within γ_{K-1} Σ|t_k| of the exact
    # sum, γ_n = n·u/(1 - n·u), u = 2^-24; so the two sums differ by ≤ 2(K-1)·u·Σ|t_k| (to
    # first order). Each is then multiplied by the same FP32 α, one more rounding (≤ u relative)
    # each: |sim - emu| ≤ (2(K-1) + 2)·u·α·Σ_k|t_k| = 2K·u·α·(|A||B|ᵀ). A wrong scale, code or
    # layout changes terms by factors ≥ 2^-3 relative, far beyond this.
    alpha = float(qa.tensor_scale * qb.tensor_scale)
    mag = qa.scaled_values().abs().double() @ qb.scaled_values().abs().double().T
    tol = 2 * k * 2.0**-24 * alpha * mag * (1 + 1e-6)
    assert ((sim.double() - emu.double()).abs() <= tol).all()
    # the BF16 outputs agree to within one BF16 ulp plus that bound
    sim16 = simulate_scaled_mm(ops, m, n).double()
    ulp = torch.finfo(torch.bfloat16).eps * emu.double().abs()
    assert ((sim16 - emu.double()).abs() <= ulp + tol).all()


def test_simulator_16x16_weight() -> None:
    qa = quantize_rtn(_data(40, 96, 5))
    qw = quantize_rtn_2d(_data(48, 96, 6))
    ops = native_operands(qa.pack(), qw.pack())
    emu = _product(Factor.of(qa), Factor.of(qw), torch.float32)
    sim = simulate_scaled_mm(ops, 40, 48, out_dtype=torch.float32)
    mag = qa.scaled_values().abs().double() @ qw.scaled_values().abs().double().T
    tol = 2 * 96 * 2.0**-24 * float(qa.tensor_scale * qw.tensor_scale) * mag * (1 + 1e-6)
    assert ((sim.double() - emu.double()).abs() <= tol).all()


def test_simulator_catches_a_wrong_layout() -> None:
    # Negative controls: scales handed over row-major (padded, not tiled), or the nibbles
    # swapped, must not pass the comparison the tests above make.
    m, n, k = 200, 72, 48
    qa, qb, ops = _operands(m, n, k, seed=99)
    emu = _product(Factor.of(qa), Factor.of(qb), torch.float32).double()
    wrong = ops.__class__(**{**vars(ops), "a_scale": pad_scales(
        unswizzle_scales(ops.a_scale, m, 4)).reshape(-1)})
    assert not torch.allclose(simulate_scaled_mm(wrong, m, n, out_dtype=torch.float32).double(),
                              emu, rtol=1e-3)
    swapped = ops.__class__(**{**vars(ops), "b_data": (ops.b_data >> 4) | (ops.b_data << 4)})
    assert not torch.allclose(simulate_scaled_mm(swapped, m, n, out_dtype=torch.float32).double(),
                              emu, rtol=1e-3)


def test_simulator_errors() -> None:
    _, _, ops = _operands(20, 24, 32, seed=4)
    with pytest.raises(ValueError, match="does not match"):
        simulate_scaled_mm(ops, 21, 24)
    with pytest.raises(ValueError, match="compute_dtype"):
        simulate_scaled_mm(ops, 20, 24, compute_dtype=torch.bfloat16)


def test_round_once_is_a_single_rounding() -> None:
    # torch's float64 → bfloat16 goes through float32 and rounds 1 + 2^-8 + 2^-40 down to 1;
    # a single rounding goes up (it is above the tie 1 + 2^-8).
    x = torch.tensor([1 + 2**-8 + 2**-40, 1 + 2**-8, -(1 + 2**-8 + 2**-40), 3.0, math.inf],
                     dtype=torch.float64)
    assert round_once(x, torch.bfloat16).tolist() == [1 + 2**-7, 1.0, -(1 + 2**-7), 3.0, math.inf]
