"""Reference quantizers (SPEC §2): error table (§5), Hadamard, unbiasedness, edge cases."""

import math
from pathlib import Path

import pytest
import torch

from quant.format import E2M1_GRID, round_e2m1, round_e4m3
from quant.hadamard import fwht, hadamard_matrix, random_signs, rotate, unrotate
from quant.quantizers import (
    EDEN_TARGET,
    quantize_ms_eden,
    quantize_rtn,
    quantize_rtn_2d,
    quantize_sr,
    stochastic_round_e2m1,
    stochastic_round_e4m3,
)
from scripts.quant_error import PAPER, error_table, rotated_errors


def loglog_slope(ns, errs) -> float:
    """Least-squares slope of log(err) against log(N)."""
    x = torch.tensor([math.log(n) for n in ns], dtype=torch.float64)
    y = torch.tensor([math.log(e) for e in errs], dtype=torch.float64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


# --- SPEC §5 error table ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_table():
    return error_table(rows=2**14, n=1024, seed=0)


@pytest.mark.parametrize("row", list(PAPER))
def test_error_table_reproduces_spec_within_5_percent(small_table, row):
    assert abs(small_table[row] - PAPER[row]) / PAPER[row] < 0.05, small_table[row]


def test_posthoc_ms_eden_error_no_worse_than_the_table(small_table):
    """SPEC §2: post hoc range alignment keeps the error no worse than MS-EDEN's §5 entry (with
    the same 5% tolerance as the reproduced rows) and within 1% of MS-EDEN on the same draws
    (seeds move these rows by under 1%; a full-precision provisional scale measured +4%)."""
    assert small_table["MS-EDEN (post hoc)"] < 1.05 * PAPER["MS-EDEN"]
    assert small_table["MS-EDEN (post hoc)"] < 1.01 * small_table["MS-EDEN"]


def test_posthoc_ms_eden_alignment():
    """The tensor scale is a power of two that puts the largest corrected scale in (224, 448],
    scales are E4M3 values, an all-zero group gets scale 0 and an all-zero tensor the tensor
    scale 1."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 128, generator=g)
    x[5, 16:32] = 0.0
    q = quantize_ms_eden(x, torch.rand(32, 8, generator=g), chunk=128, posthoc=True)
    assert math.log2(q.tensor_scale.item()).is_integer()
    assert 224.0 <= q.block_scale.max().item() <= 448.0
    assert torch.equal(round_e4m3(q.block_scale), q.block_scale)
    assert q.block_scale[5, 1].item() == 0.0 and q.q[5, 16:32].abs().sum() == 0
    z = quantize_ms_eden(torch.zeros(4, 128), torch.rand(4, 8), chunk=128, posthoc=True)
    assert z.tensor_scale.item() == 1.0 and z.dequantize().abs().sum() == 0
    with pytest.raises(ValueError, match="post hoc"):
        quantize_ms_eden(x, torch.rand(32, 8), chunk=128, posthoc=True, amax=torch.tensor(1.0))


def test_error_table_is_not_a_seed_artifact():
    """Another seed moves each rotated row by far less than the 5% tolerance."""
    a, b = rotated_errors(2**13, seed=1), rotated_errors(2**13, seed=2)
    for k in a:
        assert abs(a[k] - b[k]) / b[k] < 0.01


def test_ms_eden_beats_sr_and_nearly_matches_rtn(small_table):
    assert small_table["MS-EDEN"] < 0.5 * small_table["SR"]
    assert small_table["MS-EDEN"] < 1.15 * small_table["RTN"]


# --- grouping, shapes, errors ---------------------------------------------------------------------


def test_dim_argument_equals_grouping_the_transpose():
    x = torch.randn(64, 32)
    a = quantize_rtn(x, dim=0).dequantize()
    b = quantize_rtn(x.t().contiguous()).dequantize().t()
    assert torch.equal(a, b)


def test_leading_dims_are_independent_rows():
    x = torch.randn(3, 5, 64)
    a = quantize_rtn(x).dequantize()
    b = quantize_rtn(x.reshape(15, 64)).dequantize().reshape(3, 5, 64)
    assert torch.equal(a, b)


def test_16x16_weight_quantization_is_transpose_invariant():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * torch.logspace(-2, 2, 160)
    for fos in (False, True):
        a = quantize_rtn_2d(w, four_over_six=fos).dequantize()
        b = quantize_rtn_2d(w.t(), four_over_six=fos).dequantize().t()
        assert torch.equal(a, b)


def test_16x16_has_one_scale_per_tile():
    w = torch.randn(32, 48)
    q = quantize_rtn_2d(w)
    assert q.block_scale.shape == (2, 3)
    tile_amax = w.abs().reshape(2, 16, 3, 16).amax((1, 3))
    expected = round_e4m3(tile_amax / 6 / q.tensor_scale)
    assert torch.equal(q.block_scale, expected)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: quantize_rtn(x),
        lambda x: quantize_sr(x, torch.rand(x.shape)),
        lambda x: quantize_ms_eden(x, torch.rand(x.shape[0], 1), chunk=16),
    ],
    ids=["rtn", "sr", "ms_eden"],
)
def test_dimension_not_divisible_by_16_is_refused(fn):
    with pytest.raises(ValueError, match="not divisible by 16"):
        fn(torch.randn(4, 24))


def test_rotation_size_checks():
    with pytest.raises(ValueError, match="rotation size 48"):
        hadamard_matrix(48)
    with pytest.raises(ValueError, match="not divisible by the rotation size 128"):
        rotate(torch.randn(2, 64), torch.ones(128))


def test_rtn_tensor_and_block_scales_follow_spec():
    x = torch.randn(8, 64)
    q = quantize_rtn(x)
    assert q.tensor_scale.item() == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-7)
    assert q.q.abs().max().item() == 6.0  # the tensor amax maps to 6 exactly (scale 448)


def test_four_over_six_keeps_the_lower_error_candidate():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    q = quantize_rtn(x, four_over_six=True)
    s_t = q.tensor_scale
    assert s_t.item() == pytest.approx(x.abs().max().item() / (6 * 256), rel=1e-7)
    xg = x.reshape(256, 4, 16)
    raw = xg.abs().amax(-1, keepdim=True) / 6 / s_t
    errs = []
    for s in (round_e4m3(raw), round_e4m3(raw * 1.5)):
        v = xg / (s * s_t)
        errs.append(((round_e2m1(v) * s * s_t - xg) ** 2).sum(-1))
    chosen = ((q.dequantize().reshape(256, 4, 16) - xg) ** 2).sum(-1)
    assert torch.equal(chosen, torch.minimum(errs[0], errs[1]))
    picked_four = (errs[1] < errs[0]).float().mean().item()
    assert 0.05 < picked_four < 0.95  # both candidates are really used


FOUR_CANDIDATE = "e4m3(1.5 · (amax_b / 6 / s_t))"
"""SPEC §2's 4/6 candidate that maps a group's amax to 4, as the code computes it."""


def test_four_over_six_candidate_scales_the_unrounded_scale():
    """4/6's second candidate is ``e4m3(1.5 · (amax_b / 6 / s_t))``, one rounding of 1.5 times
    the raw scale (the authors' reference, docs/spec.md §2), not ``e4m3(1.5 · s_b)``: on groups
    where the two differ, every group that picks 4 has the first one as its block scale; and
    SPEC §2's 4/6 row says so. The two readings differ on a quarter of Gaussian groups (24.7%
    measured at 8192×8192), so 256×64 groups hold over a thousand such groups."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    q = quantize_rtn(x, four_over_six=True)
    xg = x.reshape(256, 64, 16)
    raw = xg.abs().amax(-1) / 6 / q.tensor_scale
    s6, s4, literal = round_e4m3(raw), round_e4m3(1.5 * raw), round_e4m3(1.5 * round_e4m3(raw))
    differs = s4 != literal
    assert differs.float().mean() > 0.15, differs.float().mean()
    picked4 = q.block_scale != s6
    assert torch.equal(q.block_scale[picked4], s4[picked4])
    assert (picked4 & differs).sum() > 100
    spec = (Path(__file__).resolve().parents[1] / "docs" / "spec.md").read_text(encoding="utf-8")
    row = next(line for line in spec.splitlines() if line.startswith("| 4/6 |"))
    assert FOUR_CANDIDATE in row and "1.5 · s_b" not in row, row


def test_posthoc_range_of_tiny_groups():
    """docs/spec.md §6.1's range of post hoc MS-EDEN: groups whose ``amax_b / v`` is at least
    2^-126 quantize as well as anywhere (relative MSE below 1.2e-2, 20% above SPEC §5's 9.8e-3;
    one draw of 65k elements, whose MSE varies by about 1%), groups with amax at most 2^-128
    come out as exact zeros, and ``range_alignment=amax`` keeps those within the same bound.
    Every group of a rotated Gaussian is scaled to the same amax."""
    g = torch.Generator().manual_seed(4)
    xr = rotate(torch.randn(64, 1024, generator=g), random_signs(128, g, "cpu")).double()
    unit = xr / xr.reshape(64, 64, 16).abs().amax(-1).repeat_interleave(16, -1)
    u = torch.rand(64, 64, generator=g)

    def rel_mse(amax: float, posthoc: bool) -> float:
        x = (unit * amax).float()
        d = quantize_ms_eden(x, u, posthoc=posthoc).dequantize().double()
        return float(((d - x.double()) ** 2).sum() / (x.double() ** 2).sum())

    edge = EDEN_TARGET * 2.0**-126
    for amax in (1e-30, 1e-37, edge * 1.01):
        assert rel_mse(amax, True) < 1.2e-2, amax
    for amax in (2.0**-128, 1e-40, 3e-42):
        assert rel_mse(amax, True) == 1.0, amax  # all zero
        assert rel_mse(amax, False) < 1.2e-2, amax
    section = (Path(__file__).resolve().parents[1] / "docs" / "spec.md").read_text(encoding="utf-8")
    section = " ".join(section.split("### 6.1", 1)[1].split("### 6.2", 1)[0].split())
    assert "`amax_b < v · 2^-126`" in section and "at most 2^-128 comes out as exact zeros" in section


def test_delayed_amax_saturates_values_beyond_it():
    x = torch.tensor([[1.0] * 15 + [10.0]])
    q = quantize_rtn(x, amax=torch.tensor(2.0))
    assert q.q.abs().max().item() == 6.0
    assert q.dequantize()[0, -1].item() == pytest.approx(2.0, rel=0.07)


# --- Hadamard -------------------------------------------------------------------------------------


@pytest.mark.parametrize("h", [16, 32, 64, 128])
def test_hadamard_is_orthogonal_and_symmetric(h):
    H = hadamard_matrix(h).double()
    assert torch.allclose(H @ H.t(), torch.eye(h, dtype=torch.float64), atol=1e-6)
    assert torch.equal(H, H.t())
    assert torch.allclose(H.abs(), torch.full((h, h), 1 / math.sqrt(h), dtype=torch.float64))


@pytest.mark.parametrize("h", [16, 32, 64])
def test_hadamard_sizes_are_self_consistent(h):
    """H_2h (x1, x2) = ((H_h x1 + H_h x2), (H_h x1 − H_h x2)) / √2: Sylvester's recursion."""
    x = torch.randn(5, 2 * h, dtype=torch.float32)
    ones_h, ones_2h = torch.ones(h), torch.ones(2 * h)
    a, b = rotate(x[:, :h], ones_h), rotate(x[:, h:], ones_h)
    expected = torch.cat([a + b, a - b], 1) / math.sqrt(2)
    assert torch.allclose(rotate(x, ones_2h), expected, atol=1e-5)


def test_fwht_leaves_its_input_alone_and_takes_any_layout():
    x = torch.randn(16, 8, 32, generator=torch.Generator().manual_seed(0))
    expected = fwht(x)
    assert torch.allclose(expected, x @ hadamard_matrix(32).float(), atol=1e-5)
    for view in (x.transpose(0, 1), x[::2]):
        before = view.clone()
        assert torch.equal(fwht(view), fwht(view.contiguous())) and torch.equal(view, before)
    assert torch.equal(fwht(x.bfloat16()), fwht(x.bfloat16().float()))


def test_rotation_preserves_norm_and_inverts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=g)
    s = random_signs(128, g, "cpu")
    y = rotate(x, s)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(unrotate(y, s), x, atol=1e-5)


def test_shared_signs_cancel_in_a_gemm():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 256, generator=g), torch.randn(6, 256, generator=g)
    s = random_signs(128, g, "cpu")
    assert torch.allclose(rotate(a, s) @ rotate(b, s).t(), a @ b.t(), atol=1e-4)


def test_signs_act_on_the_input_side():
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    s = torch.ones(16)
    s[0] = -1
    assert torch.allclose(rotate(x, s), -rotate(x, torch.ones(16)))


# --- stochastic rounding primitives ---------------------------------------------------------------


def test_e2m1_stochastic_rounding_probabilities_are_exact():
    """With M equally spaced uniforms, the mean of SR is v up to the 1/M grid resolution."""
    M = 4096
    u = (torch.arange(M) + 0.5) / M
    v = torch.tensor([0.1, 0.3, 1.2, 1.9, 2.2, 2.75, 3.3, 4.5, 5.99, -0.7, -5.0])
    r = stochastic_round_e2m1(v[:, None].expand(-1, M), u[None, :].expand(v.numel(), -1))
    assert torch.isin(r.abs(), E2M1_GRID).all()
    assert torch.allclose(r.mean(1), v, atol=2.0 / M)
    # only the two neighbours appear
    assert all(len(row.unique()) <= 2 for row in r)


def test_e2m1_stochastic_rounding_matches_the_neighbour_search():
    """SR's neighbours come from the FP32 bit pattern; here they come from searching the grid
    (lo = the largest grid point ≤ min(|v|, 6), hi the next one), on the grid points, the
    midpoints, their FP32 neighbours, saturating values and NaN, with random uniforms."""
    grid = E2M1_GRID
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    v = torch.cat([pts, torch.nextafter(pts, torch.tensor(-1.0)), torch.nextafter(pts, torch.tensor(9.0)),
                   torch.tensor([7.0, 1e30, float("inf"), float("nan"), 1e-45]), torch.rand(20000) * 7])
    v = torch.cat([v, -v]).repeat(4)
    u = torch.rand(v.shape, generator=torch.Generator().manual_seed(0))
    a = v.abs().clamp(max=6.0)
    lo_idx = (a.unsqueeze(-1) >= grid[1:]).sum(-1)
    lo, hi = grid[lo_idx], grid[(lo_idx + 1).clamp(max=7)]
    gap = hi - lo
    p_up = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    mag = torch.where(u < p_up, hi, lo)
    expected = torch.where(v < 0, -mag, mag)
    got = stochastic_round_e2m1(v, u)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_e4m3_stochastic_rounding_probabilities_are_exact():
    M = 4096
    u = (torch.arange(M) + 0.5) / M
    c = torch.tensor([0.0013, 0.3, 1.03, 17.7, 250.0, 300.1])
    r = stochastic_round_e4m3(c[:, None].expand(-1, M), u[None, :].expand(c.numel(), -1))
    assert torch.equal(round_e4m3(r), r)
    assert torch.allclose(r.mean(1), c, rtol=64.0 / M)


# --- unbiasedness (SPEC §5, "Testing unbiasedness") -----------------------------------------------


def _draws(kind: str, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One dequantized draw of ``x`` (rotations undone) with fresh randomness from ``g``."""
    if kind in ("sr", "sr46"):
        return quantize_sr(x, torch.rand(x.shape, generator=g), four_over_six=kind == "sr46").dequantize()
    signs = random_signs(128, g, "cpu")
    xr = rotate(x, signs)
    if kind in ("ms_eden", "ms_eden_posthoc"):
        q = quantize_ms_eden(xr, torch.rand(x.shape[0], x.shape[1] // 16, generator=g), chunk=128,
                             posthoc=kind == "ms_eden_posthoc")
    else:  # "rtn_rotated": RTN after a fresh random rotation, biased (SPEC §5)
        q = quantize_rtn(xr)
    return unrotate(q.dequantize(), signs)


def _mean_errors(kind: str, ns: list[int], seed: int = 0, shape=(64, 256)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    acc = torch.zeros_like(x, dtype=torch.float64)
    out, n = {}, 0
    for target in ns:
        while n < target:
            acc += _draws(kind, x, g).double()
            n += 1
        out[target] = ((acc / n - x) ** 2).sum().item() / (x.double() ** 2).sum().item()
    return out


POW2 = [2**k for k in range(9)]  # N = 1 … 256


@pytest.mark.parametrize("kind", ["sr", "ms_eden", "ms_eden_posthoc"])
def test_mean_of_n_quantizations_converges_at_1_over_n(kind):
    errs = _mean_errors(kind, POW2)
    slope = loglog_slope(POW2, list(errs.values()))
    assert -1.15 < slope < -0.85, (slope, errs)


def test_four_over_six_on_sr_plateaus():
    """The biased control of SPEC §3/§5: SR keeps falling as 1/N, 4/6-on-SR stalls."""
    ns = [256, 1024]
    sr, biased = _mean_errors("sr", ns), _mean_errors("sr46", ns)
    assert sr[256] / sr[1024] > 3.0  # 1/N gives 4
    assert biased[256] / biased[1024] < 1.5  # a plateau
    assert biased[1024] > 4 * sr[1024]


def _bias_ratio(kind: str, n: int, seed: int = 1) -> tuple[float, float]:
    """Pooled bias statistic after ``n`` draws, and its standard deviation under no bias.

    ``R = ‖mean − x‖² / (Σᵢ varᵢ / n)``: unbiased draws give E[R] = 1, a bias b adds
    ``n‖b‖² / Σ varᵢ``. Under no bias, R is a weighted mean of χ²₁ values with weights varᵢ, so
    its standard deviation is ``√(2 Σ varᵢ²) / Σ varᵢ``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g)
    s1 = torch.zeros_like(x, dtype=torch.float64)
    s2 = torch.zeros_like(s1)
    for _ in range(n):
        d = (_draws(kind, x, g) - x).double()
        s1 += d
        s2 += d * d
    mean = s1 / n
    var = (s2 / n - mean**2) * n / (n - 1)
    ratio = (mean**2).sum().item() / (var.sum().item() / n)
    sigma = math.sqrt(2 * (var**2).sum().item()) / var.sum().item()
    return ratio, sigma


@pytest.mark.parametrize("kind", ["sr", "ms_eden", "ms_eden_posthoc"])
def test_mean_error_is_within_standard_errors_of_zero(kind):
    """Direct bias check at N = 1024 (SPEC §5): R stays within 6σ of 1.

    6σ rather than 3σ allows for the correlation that shared scales and rotations put between
    the elements of one group, which the σ formula ignores.
    """
    ratio, sigma = _bias_ratio(kind, 1024)
    assert abs(ratio - 1) < 6 * sigma, (ratio, sigma)


def test_bias_check_detects_rtn_after_rotation():
    """The same check flags RTN after a random rotation, which has a −0.92 slope yet is biased."""
    ratio, sigma = _bias_ratio("rtn_rotated", 1024)
    assert ratio > 1 + 6 * sigma, (ratio, sigma)



def test_energy_weighted_eden_correction_weighs_groups_by_their_scale():
    """``correction="energy"`` (quantize_ms_eden's docstring): when every group of a chunk has the
    same block scale the weights are equal and the result is the chunk-scaled one bit for bit;
    the weighted sums equal ``Σ_g s_g² Σ_i v_gi / 2^(2E)`` in FP64 to FP32 rounding (a relative
    1e-5 bounds 128 additions at 2^-24 each), with weights in (0, 4); an unknown correction is a
    clear error."""
    from quant.quantizers import _energy_weights, chunk_sum, quantize_ms_eden

    g = torch.Generator().manual_seed(5)
    u = torch.rand(4, 8, generator=g)
    same = torch.randn(4, 128, generator=g).sign() * 2.0  # every group's amax is 2
    for posthoc in (False, True):
        a = quantize_ms_eden(same, u, posthoc=posthoc)
        b = quantize_ms_eden(same, u, posthoc=posthoc, correction="energy")
        assert torch.equal(a.block_scale, b.block_scale) and torch.equal(a.q, b.q)

    s_b = torch.rand(4, 8, generator=g) * 2.0 ** torch.randint(-20, 20, (4, 8), generator=g)
    v = torch.randn(4, 1, 128, generator=g)
    w = _energy_weights(s_b, 8)
    assert w.shape == (4, 1, 8) and ((w > 0) & (w < 4)).all() and (w.amax(-1) >= 1).all()
    _, e = torch.frexp(s_b.amax(-1, keepdim=True))
    norm = 4.0 ** (e.double().squeeze(-1) - 1)
    groups = v.double().reshape(4, 8, 16)
    expect = (s_b.double() ** 2 * groups.sum(-1)).sum(-1) / norm
    scale = (s_b.double() ** 2 * groups.abs().sum(-1)).sum(-1) / norm
    got = chunk_sum(v, w).reshape(4).double()
    assert ((got - expect).abs() <= 1e-5 * scale).all(), (got, expect)
    with pytest.raises(ValueError, match="unknown MS-EDEN correction"):
        quantize_ms_eden(same, u, correction="energy_weighted")
