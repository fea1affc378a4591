"""The generic autograd Function and model conversion (SPEC §3)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quant import (
    SCHEMES,
    QuantLinear,
    edge_block_patterns,
    get_scheme,
    quant_step,
    quantize_model,
    quantized_linear,
    set_quant_rng,
)
from quant.backend import use_backend
from quant.randomness import derive_seed, rng_state
from tests.test_quantizers import loglog_slope

QUANTIZED = ["nvidia", "four_over_six", "tetrajet_v2", "quartet2"]


def _grads(x, w, e, scheme, step=0, layer=0):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    with quant_step(step):
        y = quantized_linear(x, w, scheme, layer)
        dx, dw = torch.autograd.grad(y, (x, w), e)
    return y.detach(), dx, dw


def _gaussian_layer(seed=0, T=256, K=256, N=256):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, K, generator=g), torch.randn(N, K, generator=g) / math.sqrt(K),
            torch.randn(T, N, generator=g))


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_all_quantization_off_equals_f_linear(name):
    scheme = get_scheme(name, forward=False, backward=False)
    assert scheme.is_identity
    x, w = torch.randn(2, 64, 128), torch.randn(96, 128)
    e = torch.randn(2, 64, 96)
    y, dx, dw = _grads(x, w, e, scheme)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y0 = F.linear(xr, wr)
    dx0, dw0 = torch.autograd.grad(y0, (xr, wr), e)
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dw, dw0)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_all_quantization_off_equals_f_linear_under_bf16_autocast(name):
    scheme = get_scheme(name, forward=False, backward=False)
    x, w = torch.randn(64, 128, requires_grad=True), torch.randn(96, 128, requires_grad=True)
    e = torch.randn(64, 96, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = quantized_linear(x, w, scheme)
        y0 = F.linear(x, w)
    assert y.dtype == y0.dtype == torch.bfloat16
    g = torch.autograd.grad(y, (x, w), e)
    g0 = torch.autograd.grad(y0, (x, w), e)
    assert torch.equal(y, y0)
    assert all(torch.equal(a, b) for a, b in zip(g, g0))
    assert g[1].dtype == torch.float32  # FP32 master weight keeps an FP32 gradient


@pytest.mark.parametrize("name", QUANTIZED)
def test_bf16_autocast_with_fp32_master_weights(name):
    lin = quantize_model(nn.Sequential(nn.Linear(128, 128, bias=False)), name)
    x = torch.randn(4, 32, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 32, 128)
    y.float().square().mean().backward()
    w = lin[0].weight
    assert w.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_leading_batch_dims_equal_flattened(name):
    scheme = get_scheme(name)
    x, w = torch.randn(2, 3, 64, 128), torch.randn(128, 128)
    e = torch.randn(2, 3, 64, 128)
    y, dx, dw = _grads(x, w, e, scheme, step=5)
    y2, dx2, dw2 = _grads(x.reshape(-1, 128), w, e.reshape(-1, 128), scheme, step=5)
    assert torch.equal(y.reshape(-1, 128), y2)
    assert torch.equal(dx.reshape(-1, 128), dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("name", QUANTIZED)
def test_forward_equals_product_of_dequantized_operands(name):
    """Emulation = GEMM of x̂ and ŵ (tensor scales applied after, as in hardware)."""
    from quant.quantizers import quantize_rtn, quantize_rtn_2d

    scheme = get_scheme(name)
    x, w = torch.randn(64, 128), torch.randn(128, 128)
    fos = scheme.forward.a.four_over_six
    xh = quantize_rtn(x, four_over_six=fos).dequantize()
    wq = quantize_rtn_2d if scheme.forward.b.quantizer == "rtn_2d" else quantize_rtn
    wh = wq(w, four_over_six=fos).dequantize()
    y = quantized_linear(x, w, scheme)
    assert torch.allclose(y, xh @ wh.t(), rtol=1e-5, atol=1e-5)


def _one_scale_per_row(rows: int, k: int, seed: int, same_amax: bool = False) -> torch.Tensor:
    """Rows whose 16-groups all have the same amax (element 0 of each group is ± the row's amax;
    with ``same_amax`` one amax for the whole tensor): one block scale per row (per tensor), so
    every FP32 sum of quantized products below is exact in any order (≤ 23 significant bits:
    ≤ 8 from the two E4M3 scales, ≤ 15 from Σ_k q_a q_b ∈ ¼ℤ, |Σ| ≤ 36·k)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.exp(torch.randn(1 if same_amax else rows, 1, generator=g) * 2).expand(rows, 1)
    x = (torch.rand(rows, k, generator=g) * 2 - 1) * amax
    sign = torch.where(torch.rand(rows, k // 16, generator=g) < 0.5, -1.0, 1.0)
    x.view(rows, k // 16, 16)[..., 0] = sign * amax
    return x


def _hardware_epilogue(a64: torch.Tensor, b64: torch.Tensor, alpha: torch.Tensor, dtype) -> torch.Tensor:
    """The FP64 reference of the NVFP4 GEMM: the exact product of the quantized values, the FP32
    ``α · acc`` of the epilogue (exact in FP64, then rounded to FP32), one rounding to ``dtype``."""
    return ((a64 @ b64.T) * alpha.double()).float().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_scaled", [True, False])
def test_emulated_gemm_rounds_once_after_the_tensor_scales(dtype, b_scaled):
    """``_product`` applies the FP32 tensor scales before its one rounding, as the hardware
    epilogue does: equal, bit for bit, to an FP64 reference of the same quantized operands
    (``b_scaled=False``: B's values carry a power-of-two scale, as post hoc operands do). Rounding
    the unscaled product first, then scaling, differs in a good share of the outputs."""
    from quant.factor import Factor
    from quant.linear import _product
    from quant.quantizers import quantize_rtn

    qa = quantize_rtn(_one_scale_per_row(64, 256, 0))
    qb = quantize_rtn(_one_scale_per_row(96, 256, 1))
    fa = Factor.of(qa)
    fb = Factor.of(qb) if b_scaled else Factor(qb.scaled_values() * 2.0 ** -3)
    alpha = qa.tensor_scale * (qb.tensor_scale if b_scaled else 1.0)  # FP32, as α is formed
    out = _product(fa, fb, dtype, torch.float32)
    ref = _hardware_epilogue(fa.values.double(), fb.values.double(), alpha, dtype).float()
    assert torch.equal(out, ref)
    twice = ((fa.values.to(dtype) @ fb.values.to(dtype).T).float() * alpha).to(dtype).float()
    assert (twice != ref).float().mean() > 0.05  # the double rounding this replaces


def test_quantized_linear_under_autocast_rounds_once():
    """The forward of a layer under BF16 autocast (nvidia: RTN 1×16 activations, RTN 16×16
    weights) equals the FP64 reference of its quantized operands."""
    from quant.quantizers import quantize_rtn, quantize_rtn_2d

    x, w = _one_scale_per_row(64, 128, 2, same_amax=True), _one_scale_per_row(128, 128, 3, same_amax=True)
    qx, qw = quantize_rtn(x), quantize_rtn_2d(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = quantized_linear(x, w, get_scheme("nvidia"))
    ref = _hardware_epilogue(qx.scaled_values().double(), qw.scaled_values().double(),
                             qx.tensor_scale * qw.tensor_scale, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)


# --- saving for backward --------------------------------------------------------------------------


def _saved_tensors(scheme, x, w):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        quantized_linear(x, w, scheme)
    return saved


def test_quartet2_saves_packed_activations_not_bf16_copies():
    x = torch.randn(256, 512, requires_grad=True)
    w = torch.randn(384, 512, requires_grad=True)
    saved = _saved_tensors(get_scheme("quartet2"), x, w)
    big_float = [t for t in saved if t.is_floating_point() and t.numel() >= x.numel() and t is not w]
    assert not big_float, "X must be saved in packed NVFP4 form"
    packed_bytes = sum(t.numel() * t.element_size() for t in saved if t.dtype == torch.uint8)
    assert packed_bytes == (x.numel() + w.numel()) // 2  # 4 bits per value, X̂ and Ŵ


def test_nvidia_saves_high_precision_x():
    x = torch.randn(256, 512, requires_grad=True)
    w = torch.randn(384, 512, requires_grad=True)
    saved = _saved_tensors(get_scheme("nvidia"), x, w)
    assert any(t.shape == x.shape and t.dtype == torch.float32 for t in saved)


# --- randomness ----------------------------------------------------------------------------------


def test_draws_are_a_pure_function_of_the_key():
    x, w, e = _gaussian_layer(T=128, K=128, N=128)
    s = get_scheme("quartet2")
    a = _grads(x, w, e, s, step=3, layer=1)
    _grads(x, w, e, s, step=4, layer=2)  # other calls in between change nothing
    b = _grads(x, w, e, s, step=3, layer=1)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    c = _grads(x, w, e, s, step=4, layer=1)
    d = _grads(x, w, e, s, step=3, layer=2)
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[1], d[1])
    assert torch.equal(a[0], c[0])  # the forward is deterministic


def test_draws_differ_across_ranks_and_seeds():
    x, w, e = _gaussian_layer(T=128, K=128, N=128)
    s = get_scheme("tetrajet_v2")
    base = _grads(x, w, e, s, step=1)
    try:
        set_quant_rng(rank=1)
        other_rank = _grads(x, w, e, s, step=1)
        set_quant_rng(rank=0, seed=7)
        other_seed = _grads(x, w, e, s, step=1)
    finally:
        set_quant_rng(seed=0, rank=0)
    assert not torch.equal(base[1], other_rank[1]) and not torch.equal(base[1], other_seed[1])
    assert rng_state().rank == 0


def test_derive_seed_depends_on_every_part():
    base = derive_seed(1, 2, 3, 4, 5, 6)
    for i in range(6):
        parts = [1, 2, 3, 4, 5, 6]
        parts[i] += 1
        assert derive_seed(*parts) != base
    assert derive_seed(1, 2) != derive_seed(2, 1)


# --- unbiasedness of the backward pass ------------------------------------------------------------

NS = [2**k for k in range(9)]  # 1 … 256


def _backward_errors(name: str, **kw):
    """Relative squared error of the mean of N backward passes against the exact gradient of the
    quantized forward (the same scheme with backward quantization off), for N = 1 … 256."""
    x, w, e = _gaussian_layer(seed=0)
    exact = _grads(x, w, e, get_scheme(name, backward=False))
    scheme = get_scheme(name, **kw)
    sx, sw = torch.zeros_like(exact[1]), torch.zeros_like(exact[2])
    ex, ew = [], []
    for i in range(1, NS[-1] + 1):
        _, dx, dw = _grads(x, w, e, scheme, step=i)
        sx += dx
        sw += dw
        if i in NS:
            ex.append(((sx / i - exact[1]).norm() ** 2 / exact[1].norm() ** 2).item())
            ew.append(((sw / i - exact[2]).norm() ** 2 / exact[2].norm() ** 2).item())
    return ex, ew


@pytest.mark.parametrize("name", QUANTIZED)
def test_backward_is_unbiased_slope_minus_one(name):
    ex, ew = _backward_errors(name)
    sx, sw = loglog_slope(NS, ex), loglog_slope(NS, ew)
    assert abs(sx + 1) < 0.15, (sx, ex)
    assert abs(sw + 1) < 0.15, (sw, ew)


def test_four_over_six_on_sr_control_fails_the_slope_test():
    """The biased control (4/6 on SR operands, SPEC §3) plateaus: its dgrad, which has no
    rotation to average the bias away, falls outside the −1 ± 0.15 band."""
    ex, ew = _backward_errors("nvidia", sr_four_over_six=True)
    assert abs(loglog_slope(NS, ex) + 1) > 0.15, ex
    unbiased, _ = _backward_errors("nvidia")
    assert ex[-1] > 2 * unbiased[-1]


def test_single_pass_gradient_error_ms_eden_below_sr(capsys):
    """SPEC §5 gradient sanity: single-pass relative error of each scheme's gradients on a
    Gaussian layer (averaged over 8 draws); MS-EDEN (quartet2) is below the SR schemes."""
    x, w, e = _gaussian_layer(seed=1)
    rows = {}
    for name in QUANTIZED:
        exact = _grads(x, w, e, get_scheme(name, backward=False))
        errs = torch.tensor([
            [((g - r).norm() ** 2 / r.norm() ** 2).item()
             for g, r in zip(_grads(x, w, e, get_scheme(name), step=s)[1:], exact[1:])]
            for s in range(8)
        ]).mean(0)
        rows[name] = errs.tolist()
    with capsys.disabled():
        print("\n| scheme | dX rel. sq. error | dW rel. sq. error |\n|---|---|---|")
        for name, (ex, ew) in rows.items():
            print(f"| {name} | {ex:.4f} | {ew:.4f} |")
    for other in ("nvidia", "four_over_six", "tetrajet_v2"):
        assert rows["quartet2"][0] < rows[other][0]
        assert rows["quartet2"][1] < rows[other][1]


# --- model conversion -----------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d=128, hidden=256):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.lm_head = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.lm_head(x)


def test_quantize_model_swaps_every_linear_but_the_skipped():
    m = _Toy()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    quantize_model(m, "quartet2")
    kinds = {n: type(mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    assert kinds.pop("lm_head") is nn.Linear
    assert set(kinds.values()) == {QuantLinear} and len(kinds) == 6
    assert [m.blocks[i].up.layer_index for i in range(3)] == [0, 2, 4]
    assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())  # same keys, same weights
    out = m(torch.randn(2, 64, 128))
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_quantize_model_skip_patterns_and_edge_blocks():
    m = quantize_model(_Toy(), "nvidia", skip=["lm_head", *edge_block_patterns(3, first=1, last=1)])
    assert type(m.blocks[0].up) is nn.Linear and type(m.blocks[2].down) is nn.Linear
    assert type(m.blocks[1].up) is QuantLinear
    assert edge_block_patterns(12, 2, 8) == [f"blocks.{i}.*" for i in [0, 1, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_bf16_scheme_converts_nothing():
    m = _Toy()
    quantize_model(m, "bf16")
    assert not any(isinstance(mod, QuantLinear) for mod in m.modules())


def test_unknown_scheme_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'quartet3'.*quartet2"):
        quantize_model(_Toy(), "quartet3")


def test_dimension_not_divisible_by_16_names_the_layer_and_fix():
    m = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 40))
    with pytest.raises(ValueError, match=r"layer '1'.*out_features=40.*divisible by 16.*quant.skip"):
        quantize_model(m, "nvidia")


def test_dimension_not_divisible_by_rotation_names_the_layer_and_fix():
    m = nn.Sequential(nn.Linear(128, 64))  # quartet2 rotates dgrad over out-features in 128s
    with pytest.raises(ValueError, match=r"layer '0'.*out_features=64.*divisible by 128.*rotation"):
        quantize_model(m, "quartet2")
    quantize_model(nn.Sequential(nn.Linear(128, 64)), get_scheme("quartet2", rotation=64))


def test_token_count_not_divisible_by_rotation_is_refused():
    m = quantize_model(nn.Sequential(nn.Linear(128, 128, bias=False)), "quartet2")
    with pytest.raises(ValueError, match=r"tokens per micro-batch.*= 100.*divisible by 128"):
        m(torch.randn(1, 100, 128))


def test_ablation_switches():
    q = get_scheme("quartet2", four_over_six=False, rotation=32)
    assert not q.forward.a.four_over_six and q.dgrad.rotation == q.wgrad.rotation == 32
    n = get_scheme("nvidia", four_over_six=True)
    assert n.forward == SCHEMES["four_over_six"].forward
    c = get_scheme("nvidia", sr_four_over_six=True)
    assert c.dgrad.a.four_over_six and c.wgrad.a.four_over_six
    assert not get_scheme("quartet2", forward=False).forward.quantized
    b = get_scheme("tetrajet_v2", backward=False)
    assert not b.dgrad.quantized and not b.wgrad.quantized and b.forward.quantized


def test_delayed_amax_uses_the_previous_calls_amax():
    s = get_scheme("nvidia", delayed_amax=True)
    lin = quantize_model(nn.Sequential(nn.Linear(128, 128, bias=False)), s)[0]
    x = torch.randn(16, 128)
    lin(x)
    assert lin.delayed_amax[0].item() == x.abs().max().item()
    # a 4× larger input now saturates at the old amax: the output cannot follow it
    y_big = lin(4 * x)
    ref = quantize_model(nn.Sequential(nn.Linear(128, 128, bias=False)), "nvidia")[0]
    ref.weight = lin.weight
    assert not torch.allclose(y_big, ref(4 * x))
    assert lin.delayed_amax[0].item() == (4 * x).abs().max().item()
    assert "delayed_amax" in lin.state_dict()


@pytest.mark.parametrize("alignment", ["posthoc", "amax"])
def test_compiled_quantized_linear_equals_eager(alignment):
    """torch.compile (inductor, CPU reference quantizers) of a quartet2 linear gives the eager
    output and both gradients bit for bit, MS-EDEN backward included (same inputs and draws)."""
    g = torch.Generator().manual_seed(90)
    lin = nn.Sequential(nn.Linear(128, 384, bias=False))
    quantize_model(lin, get_scheme("quartet2", range_alignment=alignment), skip=[])
    x0 = torch.randn(4, 128, 128, generator=g)

    def run(fn):
        x = x0.clone().requires_grad_(True)
        with quant_step(1, 0):
            y = fn(x)
            y.square().sum().backward()
        out = (y.detach(), x.grad, lin[0].weight.grad.clone())
        lin[0].weight.grad = None
        return out

    torch._dynamo.reset()
    eager = run(lin)
    compiled = run(torch.compile(lin))
    for e, c, what in zip(eager, compiled, ("y", "dx", "dw")):
        assert torch.equal(e, c), what


def test_energy_eden_correction_changes_only_the_ms_eden_operands():
    """quartet2 with ``eden_correction=energy``: the same forward (no MS-EDEN there), backward
    gradients from the energy-weighted S (so they differ from step 4 as written under the same
    draws) that stay close to them; an unknown correction is a clear error."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(128, 128, generator=g)
    w = torch.randn(128, 128, generator=g) * 0.1
    grads = {}
    for correction in ("chunk_scaled", "energy"):
        scheme = get_scheme("quartet2", eden_correction=correction)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with use_backend("reference"):
            y = quantized_linear(xi, wi, scheme, 3)
            y.backward(torch.randn(128, 128, generator=torch.Generator().manual_seed(12)))
        grads[correction] = (y.detach(), xi.grad, wi.grad)
    (y0, dx0, dw0), (y1, dx1, dw1) = grads["chunk_scaled"], grads["energy"]
    assert torch.equal(y0, y1)
    assert torch.isfinite(dx1).all() and torch.isfinite(dw1).all()
    assert not torch.equal(dx0, dx1) and not torch.equal(dw0, dw1)
    assert (dx1 - dx0).norm() < 0.05 * dx0.norm() and (dw1 - dw0).norm() < 0.05 * dw0.norm()
    with pytest.raises(ValueError, match="unknown eden_correction"):
        get_scheme("quartet2", eden_correction="energetic")
