"""The native NVFP4 backend (quant.native), checked without Blackwell: its GEMMs run through the
simulator of the documented scaled-matmul semantics (quant.native.scaled_mm_sim), fed exactly the
tensors the native call gets, and must equal the emulated GEMMs up to accumulation order."""

import pytest
import torch

from quant import backend, get_scheme, native, quantized_linear
from quant.format import PackedNVFP4
from quant.quantizers import quantize_rtn, quantize_rtn_2d

# (tokens T, in-features K, out-features N) per scheme: every GEMM's K needs padding to 64 in
# some GEMM (forward K=80 or 144, dgrad's N=96, wgrad's T=48 or 96), and no row count is a
# multiple of 128 except where a 128-rotation forces it (quartet2's T and N).
SHAPES = {"nvidia": (48, 80, 96), "four_over_six": (48, 80, 96), "tetrajet_v2": (96, 80, 96),
          "quartet2": (128, 144, 128)}


def _layer(name: str, seed: int = 0):
    T, K, N = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5,
            torch.randn(T, N, generator=g))


def _run(x, w, e, scheme, which: str, autocast: bool = False):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with backend.use_backend(which), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = quantized_linear(x, w, scheme, layer=3)
        dx, dw = torch.autograd.grad(y, (x, w), e.to(y.dtype))
    return y.detach(), dx, dw


def _assert_one_rounding_apart(got, ref):
    """Both round once to BF16 from FP32 sums that differ only in order: equal, but where the
    two sums straddle a rounding boundary, one BF16 ulp apart (rare: under 1% of outputs)."""
    for r, o in zip(ref, got):
        assert o.dtype == r.dtype  # y in BF16; dX, dW rounded to BF16, returned in the inputs' FP32
        ulp = torch.finfo(torch.bfloat16).eps * r.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((o.float() - r.float()).abs() <= ulp).all()
        assert (o != r).float().mean() < 0.01


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_gemm_of_every_scheme_runs_native_and_equals_the_emulation(name):
    """Under BF16 autocast forward, dgrad and wgrad all go to the native call, with the shapes of
    SPEC §3's table, and give the emulated result up to FP32 accumulation order."""
    scheme = get_scheme(name)
    x, w, e = _layer(name)
    T, K, N = SHAPES[name]
    ref = _run(x, w, e, scheme, "reference", autocast=True)
    with native.simulated() as calls:
        got = _run(x, w, e, scheme, "native", autocast=True)
    assert calls == [(T, N, K), (T, K, N), (N, K, T)]  # forward X·Wᵀ, dgrad E·W, wgrad Eᵀ·X
    _assert_one_rounding_apart(got, ref)


def test_a_run_without_bf16_autocast_stays_emulated():
    """The native call is used with BF16 outputs only (what the probe checks): an FP32 run's
    GEMMs stay emulated, with the same result as the reference."""
    scheme = get_scheme("quartet2")
    x, w, e = _layer("quartet2", seed=1)
    ref = _run(x, w, e, scheme, "reference")
    with native.simulated() as calls:
        got = _run(x, w, e, scheme, "native")
    assert calls == []
    for r, o in zip(ref, got):
        assert torch.equal(o, r)


def test_a_gemm_with_a_high_precision_operand_runs_emulated():
    """Without forward quantization dgrad multiplies E (SR) by the high-precision W: not NVFP4
    on both sides, so only wgrad (E and X both quantized) goes native."""
    scheme = get_scheme("nvidia", forward=False)
    x, w, e = _layer("nvidia", seed=2)
    T, K, N = SHAPES["nvidia"]
    ref = _run(x, w, e, scheme, "reference", autocast=True)
    with native.simulated() as calls:
        got = _run(x, w, e, scheme, "native", autocast=True)
    assert calls == [(N, K, T)]
    _assert_one_rounding_apart(got, ref)


def test_16x16_weight_transposes_packed_without_decoding():
    """nvidia's dgrad reads the forward's 16×16 Ŵ as Ŵᵀ: the transposed packed form is what
    quantizing Wᵀ gives (same tiles, same tensor scale), byte for byte."""
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(3))
    t = quantize_rtn_2d(w).pack().transposed()
    direct = quantize_rtn_2d(w.t().contiguous()).pack()
    assert torch.equal(t.data, direct.data)
    assert torch.equal(t.scales.view(torch.uint8), direct.scales.view(torch.uint8))
    assert torch.equal(t.tensor_scale, direct.tensor_scale)
    with pytest.raises(ValueError, match="16x16"):
        quantize_rtn(w).pack().transposed()


def test_native_elsewhere_is_refused_with_the_reason_and_the_fix():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with backend.use_backend("native"), torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(RuntimeError) as err:
        quantized_linear(x, w, get_scheme("nvidia"))
    assert "not a CUDA GPU" in str(err.value) and "NVFP4_BACKEND=auto" in str(err.value)
    with backend.use_backend("native"), pytest.raises(RuntimeError) as err:
        backend.describe(x.device)  # what train.py says first, before any training
    assert "not a CUDA GPU" in str(err.value) and "NVFP4_BACKEND=auto" in str(err.value)


def test_auto_picks_native_only_on_blackwell(monkeypatch):
    """``auto`` asks the device: compute capability 10.x or 12.x with a torch that has the
    NVFP4 interface; Hopper (9.0) gets the reason why not. The answer is found once per GPU."""
    cuda = torch.device("cuda", 0)

    def ask():  # a GPU not asked about before
        monkeypatch.setattr(native, "_reasons", {})
        return native.unavailable_reason(cuda)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    reason = ask()
    assert "9.0" in reason and "10.x or 12.x" in reason
    monkeypatch.setattr(native, "torch_supports_nvfp4", lambda: True)
    probes = []
    monkeypatch.setattr(native, "probe", lambda device, call=None: probes.append(device))
    for cc in ((10, 0), (12, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cc=cc: cc)
        assert ask() is None
        assert native.unavailable_reason(cuda) is None  # from the cache: no second probe
    assert probes == [cuda, cuda]
    monkeypatch.setattr(native, "probe", lambda device, call=None: "it departs")
    assert ask() == "it departs"
    monkeypatch.setattr(native, "torch_supports_nvfp4", lambda: False)
    assert "lacks" in ask()
    with backend.use_backend("auto"):
        assert not backend.use_native(torch.zeros(1))  # CPU tensors: never native


def test_probe_accepts_the_documented_semantics_and_refuses_others():
    """Before the first native GEMM on a device, one small product is compared with the
    simulator: a call that matches passes; one that reads the scales unswizzled, or fails, is
    refused with the reason (``auto`` then keeps the emulated GEMMs)."""
    from quant.native.scale_layout import unswizzle_scales
    from quant.native.scaled_mm_sim import simulate_scaled_mm

    cpu = torch.device("cpu")

    def documented(ops, m, n, dtype):
        return simulate_scaled_mm(ops, m, n, dtype)

    def row_major_scales(ops, m, n, dtype):  # the scales read as if they were not swizzled
        cols = ops.k_padded // 16
        wrong = [unswizzle_scales(s, rows, cols).reshape(-1) for s, rows in ((ops.a_scale, m), (ops.b_scale, n))]
        padded = [torch.nn.functional.pad(w.view(torch.uint8), (0, s.numel() - w.numel())).view(s.dtype)
                  for w, s in zip(wrong, (ops.a_scale, ops.b_scale))]
        bad = native.NativeOperands(ops.a_data, ops.b_data, *padded, ops.a_tensor_scale, ops.b_tensor_scale,
                                    ops.k, ops.k_padded)
        return simulate_scaled_mm(bad, m, n, dtype)

    def broken(ops, m, n, dtype):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    assert native.probe(cpu, documented) is None
    assert "departs from the documented semantics" in native.probe(cpu, row_major_scales)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in native.probe(cpu, broken)


def test_native_gemm_views_kernel_byte_scales_as_e4m3():
    """The kernels write block scales as bytes (uint8); the native GEMM reads them as E4M3."""
    g = torch.Generator().manual_seed(4)
    qa, qb = quantize_rtn(torch.randn(32, 64, generator=g)), quantize_rtn(torch.randn(16, 64, generator=g))
    pa, pb = qa.pack(), qb.pack()
    as_bytes = PackedNVFP4(pa.data, pa.scales.view(torch.uint8), pa.tensor_scale, pa.dim, pa.tile)
    with native.simulated():
        assert torch.equal(native.gemm(as_bytes, pb, torch.float32), native.gemm(pa, pb, torch.float32))


def test_check_script_compares_the_paths_and_refuses_without_blackwell(capsys):
    """``scripts/check_native.py``: without Blackwell it stops with exit code 2 and the reason;
    ``--simulate`` tables the simulator against the emulation for each GEMM."""
    from scripts import check_native

    assert check_native.main(["--device", "cpu"]) == 2
    assert "not a CUDA GPU" in capsys.readouterr().err
    assert check_native.main(["--device", "cpu", "--simulate", "--schemes", "nvidia"]) == 0
    out = capsys.readouterr().out
    assert out.count("| nvidia |") == len(check_native.SHAPES) * 3 and "0 BF16 ulp(s): ok" in out


@pytest.mark.skipif(not torch.cuda.is_available() or native.unavailable_reason(torch.device("cuda")) is not None,
                    reason="needs a GPU with NVFP4 tensor cores (Blackwell) and a torch with its interface")
def test_real_native_call_equals_the_simulator():
    """On Blackwell: torch's NVFP4 scaled_mm against the simulator, for every scheme and GEMM,
    within one BF16 ulp (accumulation order)."""
    from scripts import check_native

    rows = check_native.check(torch.device("cuda"), simulate_only=False)
    assert all(r["native vs simulated"][0] <= 1 and r["simulated vs emulated"][0] <= 1 for r in rows), rows
