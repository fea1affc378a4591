"""Exhaustive tests of the NVFP4 format (SPEC §1): E2M1, E4M3, tensor scale, packing."""

import itertools
import math

import pytest
import torch

from quant.format import (
    E2M1_GRID,
    NVFP4Tensor,
    decode_e2m1,
    e4m3_block_scale,
    e4m3_neighbours,
    encode_e2m1,
    pow2_scale_for,
    round_e2m1,
    round_e4m3,
    round_e4m3_mantissa,
    tensor_scale,
)
from quant.quantizers import (
    quantize_ms_eden,
    quantize_rtn,
    quantize_rtn_2d,
    quantize_sr,
    stochastic_round_e2m1,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def brute_force_e2m1(v: float) -> float:
    """Nearest E2M1 magnitude by exhaustive search; ties to the even code (even index)."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - a), i % 2))
    return math.copysign(GRID[best], v)


def all_e4m3_values() -> torch.Tensor:
    """Every finite E4M3 value, from all 256 bit patterns (0x7F/0xFF are NaN)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    return vals[~vals.isnan()]


def test_all_16_e2m1_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = decode_e2m1(codes)
    expected = torch.tensor(GRID + [-g for g in GRID])
    assert torch.equal(vals, expected)
    assert torch.equal(encode_e2m1(vals), codes)
    assert torch.equal(round_e2m1(vals), vals)
    assert torch.signbit(vals[8]) and not torch.signbit(vals[0])  # -0 keeps its sign bit


@pytest.mark.parametrize(
    "v,expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_e2m1_ties_go_to_even(v, expected):
    assert round_e2m1(torch.tensor([v, -v])).tolist() == [expected, -expected]


def test_e2m1_matches_brute_force_including_neighbours_of_midpoints():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    pts = torch.tensor(mids)
    near = torch.cat([pts, torch.nextafter(pts, torch.zeros(1)), torch.nextafter(pts, torch.full((1,), 9.0))])
    vals = torch.cat([near, torch.linspace(0, 8, 4001), torch.rand(5000) * 7])
    vals = torch.cat([vals, -vals])
    got = round_e2m1(vals)
    ref = torch.tensor([brute_force_e2m1(v) for v in vals.tolist()])
    assert torch.equal(got, ref)


def test_e2m1_extremes_subnormals_and_nan():
    """The bit-pattern rounding at FP32's edges: subnormals go to ±0, the largest finite values
    and ±inf saturate to ±6, NaN gives 0 (the scales carry NaN, module docstring)."""
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([1e-45, tiny, 1e-30, 3.4e38, float("inf"), float("nan")])
    x = torch.cat([x, -x])
    got = round_e2m1(x)
    assert got.tolist()[:5] == [0.0, 0.0, 0.0, 6.0, 6.0] and got.tolist()[6:11] == [-0.0, -0.0, -0.0, -6.0, -6.0]
    assert torch.signbit(got[6:9]).all() and got[5].item() == 0.0 and got[11].item() == 0.0


NAN_PATTERNS = [0x7F800001, 0x7F800002, 0x7F9FFFFF, 0x7FA00000, 0x7FBFFFFF,  # signalling
                0x7FC00000, 0x7FC00001, 0x7FDFFFFF, 0x7FE00000, 0x7FFFFFFF]  # quiet
"""FP32 NaN bit patterns of every class (exponent all ones, mantissa not 0): signalling (mantissa
MSB 0) and quiet (MSB 1), at the edges of each class and where the bit-pattern rounding carries
into the exponent (0x7FA00000 up, 0x7FE00000 up); each also with the sign bit set."""


def _nan_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    payloads = torch.randint(1, 0x800000, (200,), generator=g, dtype=torch.int64)
    bits = torch.cat([torch.tensor(NAN_PATTERNS, dtype=torch.int64), 0x7F800000 | payloads])
    bits = torch.cat([bits, bits | 0x80000000])
    return bits.to(torch.int64).to(torch.uint32).view(torch.int32).view(torch.float32)


def test_e2m1_rounding_of_every_nan_pattern_is_zero():
    """Every NaN bit pattern, signalling or quiet, of either sign, rounds to +0.0 (the
    docstrings of ``round_e2m1`` and ``stochastic_round_e2m1``; the quantizers carry NaN in the
    tensor scale), whatever the uniform; never to ±6, an off-grid value or −0.0."""
    x = _nan_inputs()
    assert x.isnan().all() and x.numel() == 420
    for got in [round_e2m1(x)] + [stochastic_round_e2m1(x, torch.full_like(x, u)) for u in (0.0, 0.5, 0.999)]:
        assert torch.equal(got.view(torch.int32), torch.zeros_like(x).view(torch.int32)), got


def test_e2m1_saturates():
    x = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, -float("inf")])
    assert round_e2m1(x).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0]


def test_e4m3_every_value_is_fixed_point_and_extremes():
    vals = all_e4m3_values()
    assert vals.numel() == 254
    assert torch.equal(round_e4m3(vals), vals)
    pos = vals[vals > 0]
    assert pos.max().item() == 448.0
    assert pos.min().item() == 2.0**-9  # smallest subnormal


def test_e4m3_round_to_nearest_even_against_brute_force():
    grid = all_e4m3_values().unique().double()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.rand(4000, generator=g) * 500,
        torch.rand(2000, generator=g) * 2.0**-5,  # subnormal range
        (grid[:-1] + grid[1:]) / 2,  # every tie
    ]).double()
    x = x[x <= 448]
    got = round_e4m3(x.float()).double()
    # nearest; on a tie prefer the value with an even mantissa (even bit pattern)
    d = (x[:, None] - grid[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = d == best
    bits = grid.float().to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    even = (bits % 2 == 0)[None, :].expand_as(cand)
    choose = torch.where((cand & even).any(1, keepdim=True), cand & even, cand)
    ref = grid[choose.float().argmax(1)]
    assert torch.equal(got, ref)


def test_e4m3_saturates_and_zero_scale_becomes_one():
    assert round_e4m3(torch.tensor([449.0, 1e9, float("inf"), -500.0])).tolist() == [448, 448, 448, -448]
    assert e4m3_block_scale(torch.tensor([0.0, 2.0**-12, 3.0])).tolist() == [1.0, 1.0, 3.0]


def test_e4m3_neighbours_bracket():
    c = torch.cat([torch.rand(3000) * 460, all_e4m3_values().abs()])
    down, up = e4m3_neighbours(c)
    cc = c.clamp(max=448)
    assert (down <= cc).all() and (up >= cc).all()
    assert torch.equal(round_e4m3(down), down) and torch.equal(round_e4m3(up), up)
    exact = round_e4m3(cc) == cc
    assert torch.equal(down[exact], up[exact])
    # no E4M3 value lies strictly between the neighbours
    grid = all_e4m3_values()
    between = (grid[None, :] > down[:, None]) & (grid[None, :] < up[:, None])
    assert not between.any()


def test_e4m3_mantissa_rounding_is_e4m3_up_to_a_power_of_two():
    """Rounding to 3 mantissa bits with FP32's exponent range equals E4M3 rounding in E4M3's
    normal range (ties to even included) and commutes with powers of two beyond it."""
    g = torch.Generator().manual_seed(1)
    normal = all_e4m3_values().abs()
    normal = normal[(normal >= 2.0**-6)]
    ties = (normal[:-1] + normal[1:]) / 2
    x = torch.cat([torch.rand(5000, generator=g) * 447 + 2.0**-6, normal, ties[ties < 448]])
    assert torch.equal(round_e4m3_mantissa(x), round_e4m3(x))
    for k in (-40, -13, 9, 30):
        assert torch.equal(round_e4m3_mantissa(x * 2.0**k), round_e4m3(x) * 2.0**k)


def test_pow2_scale_for():
    """The smallest power of two s with c / s ≤ 448; 1 for 0."""
    for c in (448.0, 449.0, 300.0, 1.0, 1e-3, 5e4, 1.75 * 2.0**-3, 1.76 * 2.0**-3, 3e38, 1e-40):
        s = pow2_scale_for(torch.tensor(c)).item()
        assert math.log2(s).is_integer() and c / s <= 448 and (c / (s / 2) > 448 or s == 2.0**-126), c
    assert pow2_scale_for(torch.tensor(0.0)).item() == 1.0


def test_tensor_scale():
    assert tensor_scale(torch.tensor(2688.0), 6 * 448).item() == 1.0
    assert tensor_scale(torch.tensor(0.0), 6 * 448).item() == 1.0  # all-zero tensor


def _quantized_examples():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 256, generator=g) * torch.logspace(-3, 3, 48)[:, None]
    x[5] = 0.0  # an all-zero row: scale 1 path
    yield "rtn", quantize_rtn(x)
    yield "rtn dim0", quantize_rtn(x, dim=0)
    yield "rtn 4/6", quantize_rtn(x, four_over_six=True)
    yield "rtn 16x16", quantize_rtn_2d(x)
    yield "sr", quantize_sr(x, torch.rand(x.shape, generator=g))
    yield "ms-eden", quantize_ms_eden(x, torch.rand(48, 16, generator=g), chunk=128)


@pytest.mark.parametrize("name,q", list(_quantized_examples()), ids=lambda v: v if isinstance(v, str) else "")
def test_pack_unpack_is_bit_exact(name, q: NVFP4Tensor):
    packed = q.pack()
    assert packed.data.dtype == torch.uint8 and packed.scales.dtype == torch.float8_e4m3fn
    assert packed.data.numel() * 2 == q.q.numel()
    ref = q.dequantize()
    back = packed.dequantize()
    assert torch.equal(ref.view(torch.int32), back.view(torch.int32))  # same bits, signed zeros too
    if q.tile == "1x16":  # 4 bits per element + 8 bits per 16 elements = 4.5 bits
        assert packed.nbytes() - 4 == q.q.numel() * 4.5 / 8


def test_dequantized_values_are_on_the_nvfp4_lattice():
    q = quantize_rtn(torch.randn(16, 64))
    assert torch.isin(q.q.abs(), E2M1_GRID).all()
    assert torch.equal(round_e4m3(q.block_scale), q.block_scale)
    # q·s_b is exact in bfloat16: at most 5 significant bits
    sv = q.scaled_values()
    assert torch.equal(sv.bfloat16().float(), sv)


def test_pack_rejects_odd_length():
    q = NVFP4Tensor(q=torch.zeros(3), block_scale=torch.ones(1), tensor_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="even"):
        q.pack()


def test_codes_cover_every_pair_in_a_byte():
    pairs = torch.tensor(list(itertools.product(range(16), repeat=2)), dtype=torch.uint8).flatten()
    vals = decode_e2m1(pairs).reshape(1, -1)[:, :512]
    q = NVFP4Tensor(q=vals, block_scale=torch.ones(1, 32), tensor_scale=torch.tensor(1.0))
    back = q.pack().unpack().q
    assert torch.equal(back.view(torch.int32), vals.view(torch.int32))
