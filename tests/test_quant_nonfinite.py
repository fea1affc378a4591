"""NaN and ±inf through the reference quantizers and the quantized linear layer: the rule in the
docstring of :mod:`quant.quantizers` (a NaN or ±inf anywhere in a tensor makes the whole
quantized tensor NaN, through a NaN tensor scale), so a non-finite gradient or activation
never leaves a quantized GEMM finite, let alone zero. The kernels' side is in
tests/test_kernels.py (``test_non_finite_*``)."""

from __future__ import annotations

import math

import pytest
import torch

from quant import SCHEMES, get_scheme, quant_step, quantized_linear
from quant.format import pow2_scale_for, tensor_scale
from quant.hadamard import random_signs, rotate
from quant.linear import _amax
from quant.quantizers import quantize_ms_eden, quantize_rtn, quantize_rtn_2d, quantize_sr

BAD = [math.nan, math.inf, -math.inf]
SIGNS = random_signs(128, torch.Generator().manual_seed(1), "cpu")
DELAYED = torch.tensor(2.5)  # a finite delayed amax, below the data's


def _uniforms(shape, seed=2):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


QUANTIZERS = {
    "rtn": lambda x: quantize_rtn(x),
    "rtn_dim0": lambda x: quantize_rtn(x, dim=0),
    "rtn_4/6": lambda x: quantize_rtn(x, four_over_six=True),
    "rtn_16x16": lambda x: quantize_rtn_2d(x),
    "rtn_16x16_4/6": lambda x: quantize_rtn_2d(x, four_over_six=True),
    "sr": lambda x: quantize_sr(x, _uniforms(x.shape)),
    "sr_4/6": lambda x: quantize_sr(x, _uniforms(x.shape), four_over_six=True),
    "rht16_rtn": lambda x: quantize_rtn(rotate(x, SIGNS[:16])),
    "rht32_sr": lambda x: quantize_sr(rotate(x, SIGNS[:32]), _uniforms(x.shape)),
    "ms_eden": lambda x: quantize_ms_eden(rotate(x, SIGNS), _uniforms((x.shape[0], x.shape[1] // 16))),
    "ms_eden_posthoc": lambda x: quantize_ms_eden(rotate(x, SIGNS), _uniforms((x.shape[0], x.shape[1] // 16)),
                                                  posthoc=True),
    "rtn_delayed": lambda x: quantize_rtn(x, amax=DELAYED),
    "sr_delayed": lambda x: quantize_sr(x, _uniforms(x.shape), amax=DELAYED),
    "ms_eden_delayed": lambda x: quantize_ms_eden(rotate(x, SIGNS), _uniforms((x.shape[0], x.shape[1] // 16)),
                                                  amax=DELAYED),
}


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 256, generator=g) * torch.logspace(-2, 2, 256)


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_one_non_finite_element_makes_the_whole_tensor_nan(name, bad):
    """One NaN or ±inf (row 5, column 37: one group; with rotation, one chunk) makes the tensor
    scale NaN and every dequantized element NaN, in the emulation and the packed form; the same
    tensor with a finite value there quantizes to finite values."""
    x = _data()
    fine = QUANTIZERS[name](x)
    assert torch.isfinite(fine.tensor_scale) and torch.isfinite(fine.dequantize()).all()
    x[5, 37] = bad
    q = QUANTIZERS[name](x)
    assert torch.isnan(q.tensor_scale), q.tensor_scale
    assert torch.isnan(q.dequantize()).all()
    assert torch.isnan(q.pack().dequantize()).all()


def test_scales_of_a_non_finite_amax_are_nan():
    """``tensor_scale`` and post hoc MS-EDEN's ``pow2_scale_for`` of NaN or +inf are NaN; of 0
    still 1, and of finite values unchanged (SPEC §2)."""
    for bad in (math.nan, math.inf):
        assert torch.isnan(tensor_scale(torch.tensor(bad), 6 * 448))
        assert torch.isnan(pow2_scale_for(torch.tensor(bad)))
    assert tensor_scale(torch.tensor(0.0), 6 * 448).item() == 1.0
    assert pow2_scale_for(torch.tensor(0.0)).item() == 1.0
    assert tensor_scale(torch.tensor(2688.0), 6 * 448).item() == 1.0
    assert pow2_scale_for(torch.tensor(3e38)).item() == 2.0**120


def test_delayed_amax_skips_a_non_finite_previous_amax():
    """The layer's delayed-amax buffer: a previous amax that is NaN or +inf (a call that saw
    one) is not reused, as a previous 0 is not; a finite one is. The current amax is stored."""
    x = _data()
    current = x.abs().amax()
    delayed = torch.tensor([math.inf, math.nan, 0.0, 2.5, 0.0, 0.0])
    assert _amax(x, delayed, 0) == current and _amax(x, delayed, 1) == current
    assert _amax(x, delayed, 2) == current and _amax(x, delayed, 3) == 2.5
    assert torch.equal(delayed[:4], current.expand(4))


# --- the quantized linear layer -----------------------------------------------------------------

CASES = [(name, {}) for name in SCHEMES] + [("quartet2", {"range_alignment": "amax"}),
                                              ("quartet2", {"delayed_amax": True}),
                                              ("nvidia", {"delayed_amax": True})]


def _layer(seed=0, T=128, K=128, N=128):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, K, generator=g), torch.randn(N, K, generator=g) / math.sqrt(K),
            torch.randn(T, N, generator=g))


def _grads(scheme, x, w, e):
    """Y, dX, dW of one call; with delayed amax, after a first call on finite data of the same
    shape, so that the delayed amax in use is finite."""
    delayed = torch.zeros(6) if scheme.delayed_amax else None
    if delayed is not None:
        x0, w0, e0 = _layer(seed=1)
        with quant_step(0):
            quantized_linear(x0.requires_grad_(), w0.requires_grad_(), scheme, 0, delayed).backward(e0)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with quant_step(1):
        y = quantized_linear(x, w, scheme, 0, delayed)
        dx, dw = torch.autograd.grad(y, (x, w), e)
    return y.detach(), dx, dw


def _case_id(case):
    name, kw = case
    return name + "".join(f"-{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_nan_upstream_gradient_makes_both_gradients_non_finite(case):
    """A NaN in the upstream gradient E (token 3, out-feature 7): a quantized dgrad or wgrad is
    NaN everywhere (E's tensor scale is NaN); an unquantized one is NaN where a plain GEMM
    puts it (dX's row 3, dW's row 7). Never zero."""
    name, kw = case
    scheme = get_scheme(name, **kw)
    x, w, e = _layer()
    e[3, 7] = math.nan
    y, dx, dw = _grads(scheme, x, w, e)
    assert torch.isfinite(y).all()
    if scheme.dgrad.quantized:
        assert torch.isnan(dx).all()
    else:
        assert torch.isnan(dx[3]).all() and torch.isfinite(dx[4:]).all()
    if scheme.wgrad.quantized:
        assert torch.isnan(dw).all()
    else:
        assert torch.isnan(dw[7]).all() and torch.isfinite(dw[8:]).all()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_inf_in_x_makes_y_and_dw_non_finite(case):
    """An inf in X (token 3, in-feature 5): a quantized forward or wgrad is NaN everywhere; an
    unquantized one is non-finite where a plain GEMM puts it (Y's row 3, dW's column 5). dX
    (``E W``) does not read X and stays finite."""
    name, kw = case
    scheme = get_scheme(name, **kw)
    x, w, e = _layer()
    x[3, 5] = math.inf
    y, dx, dw = _grads(scheme, x, w, e)
    if scheme.forward.quantized:
        assert torch.isnan(y).all()
    else:
        assert not torch.isfinite(y[3]).any() and torch.isfinite(y[4:]).all()
    if scheme.wgrad.quantized:
        assert torch.isnan(dw).all()
    else:
        assert not torch.isfinite(dw[:, 5]).any() and torch.isfinite(dw[:, 6:]).all()
    assert torch.isfinite(dx).all()


# --- finite inputs too small for SPEC §2's tensor scale: never NaN ------------------------------

TINY_AMAXES = [1e-42, 2.0**-149, 2.0**-146, 2.0**-140]
"""Tensor amaxes whose ``amax / target`` rounds to 0 for every quantizer's target (they lie below
``target · 2^-150``: 1.9e-42 for RTN's 6·448, 1.1e-42 for 4/6's 6·256 and MS-EDEN's 255.99·v),
from FP32's least positive value up."""


def _tiny(amax: float) -> torch.Tensor:
    """32×256 zeros (all-zero groups everywhere) but for ``amax`` at row 0, column 0 and a few
    multiples of 2^-149 below it in row 1."""
    x = torch.zeros(32, 256)
    x[0, 0] = amax
    x[1, 16:20] = torch.tensor([1.0, -2.0, 3.0, -5.0]) * 2.0**-149
    return x


@pytest.mark.parametrize("amax", TINY_AMAXES, ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_a_tiny_tensor_quantizes_to_finite_values(name, amax):
    """The tensor scale floor (SPEC §2): a finite tensor whose ``amax / target`` rounds to 0
    gets the tensor scale 2^-149, not 0, so no all-zero group's block scale is ``0 / 0``: every
    quantizer's values are finite, in the emulation and the packed form, and the all-zero
    groups are exactly 0 (the issue's reproducer is ``amax = 1e-42``)."""
    q = QUANTIZERS[name](_tiny(amax))
    assert q.tensor_scale > 0, q.tensor_scale
    d = q.dequantize()
    assert torch.isfinite(d).all() and torch.isfinite(q.pack().dequantize()).all()
    if "rht" not in name and "ms_eden" not in name:  # unrotated: the zero rows stay zero
        assert (d[2:] == 0).all()


def test_the_floor_keeps_a_tiny_element():
    """``x = 1e-42`` (714 · 2^-149 in FP32) among zeros: ``s_t = 2^-149``, the block scale is
    ``e4m3(119) = 120`` and the element maps to 714/120 ≈ 5.95, i.e. 6, so it dequantizes to
    720 · 2^-149 (relative error 0.8%, within E4M3's half spacing 1/16 of the block scale).
    SR: ``amax / 6'`` rounds to 126 · 2^-149, the block scale is ``e4m3(126) = 128`` and
    714/128 ≈ 5.58 rounds to 4 or 6: 512 or 768 times 2^-149."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1e-42
    q = quantize_rtn(x)
    assert q.tensor_scale.item() == 2.0**-149 and q.block_scale.tolist() == [[120.0, 1.0]]
    d = q.dequantize()
    assert d[0, 0].item() == 720 * 2.0**-149 and (d[0, 1:] == 0).all()
    s = quantize_sr(x, _uniforms(x.shape)).dequantize()
    assert s[0, 0].item() in (512 * 2.0**-149, 768 * 2.0**-149) and (s[0, 1:] == 0).all()


def test_tensor_scale_floor_changes_only_a_zero_scale():
    """``tensor_scale`` is ``amax / target`` bit for bit wherever that is not 0 (down to the
    subnormal 2^-149 itself), and 2^-149 where it rounds to 0."""
    amax = torch.tensor([2.0**-149, 1e-42, 2.0**-137, 2.0**-130, 1e-38, 1e-20, 1.0, 3e38])
    for target in (6 * 448, 6 * 256, 6 * 16 / 17 * 448, 255.99 * 6 / ((17 / 16) * 0.93)):
        plain = amax / torch.tensor(target, dtype=torch.float32)
        got = tensor_scale(amax, target)
        assert torch.equal(got, torch.where(plain > 0, plain, torch.tensor(2.0**-149))), target
        assert (plain == 0).any() and (plain > 0).any()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_tiny_upstream_gradient_gives_finite_gradients(case):
    """An upstream gradient that is 0 but for one element of 1e-42 (token 3, out-feature 7):
    every quantized dgrad and wgrad is finite (its quantized E has the floored tensor scale
    2^-149, SPEC §2), under every scheme."""
    name, kw = case
    scheme = get_scheme(name, **kw)
    x, w, _ = _layer()
    e = torch.zeros(128, 128)
    e[3, 7] = 1e-42
    y, dx, dw = _grads(scheme, x, w, e)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
