"""The fused Triton quantizers (quant/kernels) against the pure-PyTorch reference, bit for bit.

Without CUDA the kernels run under triton's CPU interpreter, in subprocesses that this module
starts with ``TRITON_INTERPRET=1`` (``test_interpreter_subprocess``, one per group of tests, so
the variable never reaches other test modules), with the interpreter's fp8/bf16 conversion bugs
patched (:mod:`quant.kernels.interpreter`). With CUDA the same tests run on the GPU
(``@pytest.mark.gpu``), the reference running on CPU copies of the inputs (the reference on CUDA
divides by a Python constant through its reciprocal, see docs/performance.md).

Shapes exercise masking and non-square tiles: 48×160 and 144×256, quantized along rows and
along columns. Stochastic kernels get the same uniforms as the reference, either explicitly or
as the Philox draws materialised by ``nvfp4::philox_uniforms``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run in triton's interpreter, which needs TRITON_INTERPRET=1 before
# triton itself is first imported (its own @jit helpers such as tl.sum and tl.rand are decorated
# at import). So this module re-runs itself in subprocesses with the variable set, one per group
# of its tests (INTERPRETER_GROUPS); in the parent process only test_interpreter_subprocess runs
# (the variable never leaks into other modules).
INTERP_CHILD = os.environ.get("NVFP4_KERNEL_TESTS") == "interpreter"
if not CUDA and not INTERP_CHILD:
    pytest.importorskip("triton")
    K = kops = None
else:
    pytest.importorskip("triton")
    import quant.kernels as K
    from quant.kernels import ops as kops

    if not CUDA and not kops._INTERPRET:
        raise RuntimeError("the interpreter child must run with TRITON_INTERPRET=1")

import quant  # noqa: E402
from quant import backend, randomness  # noqa: E402
from quant.factor import Factor  # noqa: E402
from quant.format import PackedNVFP4  # noqa: E402
from quant.hadamard import random_signs, rotate, unrotate  # noqa: E402
from quant.quantizers import (  # noqa: E402
    quantize_ms_eden,
    quantize_rtn,
    quantize_rtn_2d,
    quantize_sr,
)

DEV = "cuda" if CUDA else "cpu"
RUN_HERE = CUDA or INTERP_CHILD
pytestmark = [pytest.mark.gpu] if CUDA else []


@pytest.fixture(autouse=True)
def _only_where_kernels_run(request):
    if not RUN_HERE and request.node.originalname != "test_interpreter_subprocess":
        pytest.skip("runs in an interpreter subprocess (test_interpreter_subprocess)")


INTERPRETER_GROUPS = {
    "compiled_blocks": ["test_compiled_blocks_compile_once"],
    "compiled": ["test_compiled_backward_reads_one_e", "test_compiled_blocks_keep_the_autocast_dtype",
                 "test_function_compiles_as_one_graph"],
    "gpu_tiles": ["test_gpu_tile_shapes"],
    "tiles": ["test_tiles_per_program", "test_posthoc_sparse_fixes", "test_shared_eden_draws",
              "test_non_finite_posthoc_rewrites_every_program"],
    "function": ["test_function_matches_reference", "test_function_non_finite_matches_reference",
                 "test_function_philox_draws_deterministic", "test_philox_stream_on_both_paths",
                 "test_saved_packed_operand_roundtrip"],
    "rest": [],
}
"""The groups of this module's tests that the interpreter runs, one subprocess each (by test
function; ``rest`` is every test not named in another group), so that no parent test runs for
more than a few minutes."""

INTERPRETER_TIMEOUT_S = {"compiled_blocks": 300, "compiled": 300, "gpu_tiles": 240, "tiles": 180,
                         "function": 180, "rest": 180}
"""Each group's timeout, at least 4× its time on a quiet 2-core machine: 75, 65, 44, 26, 31 and
34 s in the order above (276 s for the six)."""


def _group_tests(group: str) -> list[str]:
    """The test functions of an interpreter group: its list, or for ``rest`` every test function
    of this module that no other group names (so that each runs in exactly one group)."""
    named = [t for g, tests in INTERPRETER_GROUPS.items() if g != "rest" for t in tests]
    tests = {n for n, f in globals().items() if n.startswith("test_") and callable(f)}
    tests.discard("test_interpreter_subprocess")
    unknown = sorted(set(named) - tests)
    assert not unknown, f"INTERPRETER_GROUPS names tests that do not exist: {unknown}"
    assert len(named) == len(set(named)), "a test is in two INTERPRETER_GROUPS"
    return INTERPRETER_GROUPS[group] or sorted(tests - set(named))


INTERPRETER_CHILDREN = 2
"""How many interpreter groups run at once: each child is single-threaded, so two use the two
cores of a CI machine (the groups start longest first, in :data:`INTERPRETER_GROUPS`' order)."""


def _run_interpreter_group(group: str) -> subprocess.CompletedProcess[str]:
    """One group's tests (:data:`INTERPRETER_GROUPS`) in a pytest subprocess under triton's
    interpreter, torch on one thread (``OMP_NUM_THREADS=1``): the interpreter's work is
    single-threaded numpy and small torch ops, which a second intra-op thread does not speed up
    and which, on a host whose cores are busy, it slowed down a hundredfold (a 37k-element
    compare: 12 ms against 0.05 ms)."""
    env = dict(os.environ, TRITON_INTERPRET="1", NVFP4_KERNEL_TESTS="interpreter", OMP_NUM_THREADS="1")
    env.pop("NVFP4_BACKEND", None)
    here = Path(__file__).resolve()
    ids = [f"{here}::{name}" for name in _group_tests(group)]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *ids],
                          cwd=here.parents[1], env=env, capture_output=True, text=True,
                          timeout=INTERPRETER_TIMEOUT_S[group])


@pytest.fixture(scope="module")
def interpreter_runs(request):
    """``{group: future of its subprocess}`` for the groups among the collected tests,
    :data:`INTERPRETER_CHILDREN` at a time, all started at the first test that asks."""
    selected = {item.callspec.params["group"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_interpreter_subprocess"}
    with ThreadPoolExecutor(INTERPRETER_CHILDREN) as pool:
        yield {g: pool.submit(_run_interpreter_group, g) for g in INTERPRETER_GROUPS if g in selected}


@pytest.mark.skipif(RUN_HERE, reason="the parent of the interpreter run")
@pytest.mark.parametrize("group", list(INTERPRETER_GROUPS))
def test_interpreter_subprocess(interpreter_runs, group):
    """One group of this module's tests (:data:`INTERPRETER_GROUPS`), bit-exact, on CPU under
    triton's interpreter, in a subprocess (:func:`_run_interpreter_group`)."""
    r = interpreter_runs[group].result()
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


SHAPES = [(48, 160), (144, 256)]


def _tune(monkeypatch, tile=None, **changes):
    """Run this test under the tuning in use with ``changes`` (fields of ``KernelTuning``;
    ``tiles_per_program`` as one number for every layout) and, with ``tile``, that tile for
    every layout that takes it (the on-chip transposing ``cols`` layouts need BM >= 16)."""
    from quant.kernels import tuning

    base = tuning.get_tuning()
    if "tiles_per_program" in changes:
        changes["tiles_per_program"] = dict.fromkeys(tuning.LAYOUTS, changes["tiles_per_program"])
    if tile is not None:
        changes["tiles"] = {layout: tile for layout in tuning.LAYOUTS
                            if tile[0] >= 16 or layout not in ("cols", "cols_wide")}
    monkeypatch.setattr(tuning, "_current", tuning.tuning_from_mapping(changes, base))


def _data(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[1])
    x[0, :16] = 0.0  # an all-zero group (block scale 1) ...
    x[1, 16:32] = -0.0
    x[2, 3] = 1e-30  # ... and tiny values (E4M3 subnormal scales)
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _check(out, ref, packed=True, posthoc=False):
    """``out`` = kernel op outputs (values, codes, scales, tensor_scale, amax) vs an NVFP4Tensor;
    ``posthoc``: the values carry the tensor scale, ``(q · s_block) · s_tensor``."""
    values, codes, scales, st, _ = (t.cpu() for t in out)
    assert values.dtype == torch.bfloat16
    expect = ref.dequantize().bfloat16() if posthoc else ref.scaled_values()
    assert torch.equal(_bits(values), _bits(expect)), "values differ"
    assert torch.equal(_bits(st), _bits(ref.tensor_scale)), "tensor scale differs"
    if packed:
        p = ref.pack()
        assert torch.equal(codes, p.data), "codes differ"
        assert torch.equal(scales.view(torch.uint8), p.scales.view(torch.uint8)), "scales differ"


def _logical(x, transpose):
    return x.t() if transpose else x


def _rot(k: int) -> int:
    return next(h for h in (128, 32, 16) if k % h == 0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rtn(shape, transpose, four_over_six, dtype):
    x = _data(shape, dtype=dtype)
    out = K.rtn(x.to(DEV), transpose, four_over_six)
    _check(out, quantize_rtn(_logical(x, transpose), four_over_six=four_over_six))
    assert out[4].cpu() == x.float().abs().amax()


@pytest.mark.parametrize("shape", [(48, 160), (144, 256), (160, 48)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_rtn_2d(shape, transpose, four_over_six):
    x = _data(shape, seed=1)
    out = K.rtn_2d(x.to(DEV), transpose, four_over_six)
    _check(out, quantize_rtn_2d(_logical(x, transpose), four_over_six=four_over_six))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_sr_explicit_uniforms(shape, transpose, four_over_six):
    x = _data(shape, seed=2)
    a = _logical(x, transpose)
    u = torch.rand(a.shape, generator=torch.Generator().manual_seed(3))
    out = K.sr(x.to(DEV), transpose, u.to(DEV), None, four_over_six)
    _check(out, quantize_sr(a, u, four_over_six=four_over_six))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("stream", [0, 77])
def test_sr_seeded_draws(shape, transpose, stream):
    """The seeded SR kernel draws exactly ``philox_uniforms`` of its stream. The mean of n ≥ 7680
    uniforms has sd ≤ 0.0033, so |mean − 0.5| < 0.02 is a 6-sd check."""
    x = _data(shape, seed=4)
    a = _logical(x, transpose)
    seed = torch.tensor([123456789012345], dtype=torch.int64, device=DEV)
    u = K.philox_uniforms(seed, a.numel(), "sr", stream).cpu().reshape(a.shape)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.02
    out = K.sr(x.to(DEV), transpose, None, seed, stream=stream)
    _check(out, quantize_sr(a, u))


def test_philox_streams_and_signs():
    """Streams of one key are different sequences; signs are ±1, a pure function of (key,
    stream), prefixes of one another, and differ across streams. For h = 4096 fair signs the sum
    has sd 64, so |sum| < 384 is a 6-sd check."""
    seed = torch.tensor([42], dtype=torch.int64, device=DEV)
    u0 = K.philox_uniforms(seed, 1024, "sr", 0).cpu()
    u1 = K.philox_uniforms(seed, 1024, "sr", 1).cpu()
    assert not torch.equal(u0, u1)
    s = K.philox_signs(seed, 4096, 9).cpu()
    assert set(s.unique().tolist()) == {-1.0, 1.0} and abs(s.sum().item()) < 384
    assert torch.equal(s, K.philox_signs(seed, 4096, 9).cpu())
    assert not torch.equal(s, K.philox_signs(seed, 4096, 10).cpu())
    assert torch.equal(K.philox_signs(seed, 16, 9).cpu(), s[:16])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("posthoc", [False, True])
def test_rht_ms_eden(shape, transpose, seeded, posthoc):
    """Rotation + MS-EDEN, with the tensor amax pass or post hoc range alignment (two passes:
    codes and corrected scales, then the alignment), given explicit or Philox draws."""
    x = _data(shape, seed=5)
    a = _logical(x, transpose)
    h = _rot(a.shape[1])
    signs = random_signs(h, torch.Generator().manual_seed(6), "cpu")
    if seeded:
        seed = torch.tensor([987654321], dtype=torch.int64, device=DEV)
        u = K.philox_uniforms(seed, a.numel() // 16, "ms_eden", 5, a.shape[1] // 16).cpu()
        u = u.reshape(a.shape[0], -1)
        out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, None, seed, None, True, stream=5,
                            posthoc=posthoc)
    else:
        u = torch.rand(a.shape[0], a.shape[1] // 16, generator=torch.Generator().manual_seed(7))
        out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, u.to(DEV), None, None, True,
                            posthoc=posthoc)
    xr = rotate(a, signs)
    _check(out, quantize_ms_eden(xr, u, chunk=h, posthoc=posthoc), posthoc=posthoc)
    if not posthoc:  # the amax output: max |A| after rotation (post hoc: max(c), not an amax)
        assert out[4].cpu() == xr.abs().amax()


@pytest.mark.parametrize("shape,h,transpose,seeded", [((48, 160), 32, False, False),
                                                      ((128, 256), 128, False, False),
                                                      ((48, 256), 64, True, True)], ids=str)
@pytest.mark.parametrize("posthoc", [False, True])
def test_rht_ms_eden_energy(shape, h, transpose, seeded, posthoc):
    """MS-EDEN with ``eden_correction="energy"`` (step 4's S with each group weighted by its
    block scale squared, normalised by the chunk's power-of-two top scale) gives the reference's
    bits, with the tensor amax pass or post hoc alignment, explicit or Philox draws: masked
    tiles (48×160, chunks of 32; 48 rows of columns, chunks of 64) and a whole one (128×256,
    chunks of 128). The operand is ``unrotate`` of one whose 16-groups span 2^-6 … 2^6, so that
    the groups of each rotated chunk have very different block scales and the weights matter
    (the result differs from chunk_scaled's), and one rotated chunk is all zero."""
    g = torch.Generator().manual_seed(8)
    y = torch.randn(shape, generator=g)
    e = torch.randint(-6, 7, (shape[0], shape[1] // 16, 1), generator=g)
    y = (y.reshape(shape[0], -1, 16) * torch.exp2(e)).reshape(shape)
    y[1, :h] = 0.0
    signs = random_signs(h, g, "cpu")
    a = unrotate(y, signs)
    x = a.t().contiguous() if transpose else a
    if seeded:
        seed = torch.tensor([24681357], dtype=torch.int64, device=DEV)
        u = K.philox_uniforms(seed, a.numel() // 16, "ms_eden", 1, a.shape[1] // 16).cpu()
        u = u.reshape(a.shape[0], -1)
        draws = dict(seed=seed, stream=1)
    else:
        u = torch.rand(a.shape[0], a.shape[1] // 16, generator=g)
        draws = dict(uniforms=u.to(DEV))
    xr = rotate(a, signs)
    assert (xr[1, :h] == 0).all()
    ref = quantize_ms_eden(xr, u, chunk=h, posthoc=posthoc, correction="energy")
    scaled = quantize_ms_eden(xr, u, chunk=h, posthoc=posthoc)
    assert not torch.equal(ref.dequantize(), scaled.dequantize())
    out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, pack=True, posthoc=posthoc,
                        eden_correction="energy", **draws)
    _check(out, ref, posthoc=posthoc)


def test_eden_correction_is_checked():
    """``eden_correction`` is MS-EDEN's: an unknown one, or energy on another quantizer, is an
    error before any launch."""
    x = torch.zeros(16, 128, device=DEV)
    signs = random_signs(128, torch.Generator().manual_seed(1), "cpu").to(DEV)
    u = torch.zeros(16, 8, device=DEV)
    with pytest.raises(ValueError, match="'energetic' for ms_eden"):
        K.rht_ms_eden(x, signs, uniforms=u, eden_correction="energetic")
    with pytest.raises(ValueError, match="'energy' for rtn"):
        K.quantize_operand(x, None, kops.SRC_DENSE, False, None, None, None, None, None, 0, "rtn",
                           False, True, True, eden_correction="energy")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_posthoc_small_groups(transpose, pack):
    """Post hoc alignment's first pass writes values with the tensor scale folded in, exact
    only where the group's scale lands in E4M3's normal range; the align pass rewrites the
    others from the codes, which the first pass writes with or without ``pack``. Rows spanning
    2^0 … 2^-40 put both kinds of group in every tile."""
    g = torch.Generator().manual_seed(60)
    x = torch.randn(64, 256, generator=g) * torch.exp2(-torch.linspace(0, 40, 64))[:, None]
    x = x.bfloat16()
    a = _logical(x, transpose)
    signs = random_signs(_rot(a.shape[1]), g, "cpu")
    u = torch.rand(a.shape[0], a.shape[1] // 16, generator=g)
    ref = quantize_ms_eden(rotate(a, signs), u, chunk=len(signs), posthoc=True)
    sub = ref.block_scale < 2.0**-6
    assert sub.any() and not sub.all()
    out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, u.to(DEV), None, None, pack, posthoc=True)
    _check(out, ref, packed=pack, posthoc=True)


@pytest.mark.parametrize("posthoc", [False, True])
def test_extreme_magnitudes(posthoc):
    """The kernels' per-group division (reciprocal + FMA residual, with divisors below 2^-64
    scaled first) gives the reference's IEEE quotients bit for bit at the edges of the range: in
    one tensor, groups from 2^-133 (BF16's smallest subnormal) to 2^100, a group of subnormals
    and one mixing a normal element with subnormals; and a whole tensor around 2^-128, whose
    block scales are FP32 subnormals. MS-EDEN under both corrections (``energy``: its weights
    ``(s_g / 2^E)²`` from these scales, post hoc down to ``s_p = 2^-126``)."""
    g = torch.Generator().manual_seed(50)
    x = torch.randn(32, 256, generator=g)
    e = torch.linspace(-133, 100, 32 * 16).round().reshape(32, 16, 1)
    x = (x.reshape(32, 16, 16) * torch.exp2(e)).reshape(32, 256)
    x[5, 16:32] = torch.exp2(torch.tensor(-133.0)) * torch.arange(16)  # subnormals only
    x[6, 32:48] = torch.exp2(torch.tensor(-130.0)) * torch.arange(16)
    x[6, 32] = 3.0  # one normal element among subnormals
    tiny = torch.randn(32, 256, generator=g) * 2.0**-128
    u = torch.rand(32, 256, generator=g)
    ug = torch.rand(32, 16, generator=g)
    signs = random_signs(128, g, "cpu")
    for xb in (x.bfloat16(), tiny.bfloat16()):
        for four_six in (False, True):
            _check(K.rtn(xb.to(DEV), False, four_six), quantize_rtn(xb, four_over_six=four_six))
            _check(K.sr(xb.to(DEV), False, u.to(DEV), None, four_six),
                   quantize_sr(xb, u, four_over_six=four_six))
        for correction in ("chunk_scaled", "energy"):
            ref = quantize_ms_eden(rotate(xb, signs), ug, chunk=128, posthoc=posthoc, correction=correction)
            for pack in (True, False):  # post hoc, the align pass also fixes values without pack
                out = K.rht_ms_eden(xb.to(DEV), signs.to(DEV), False, ug.to(DEV), None, None, pack,
                                    posthoc=posthoc, eden_correction=correction)
                _check(out, ref, packed=pack, posthoc=posthoc)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_rht_sr_and_rht_rtn(shape, transpose):
    x = _data(shape, seed=8, dtype=torch.bfloat16)
    a = _logical(x, transpose)
    h = _rot(a.shape[1])
    h = 32 if a.shape[1] % 32 == 0 else 16
    signs = random_signs(h, torch.Generator().manual_seed(9), "cpu")
    xr = rotate(a, signs)
    u = torch.rand(a.shape, generator=torch.Generator().manual_seed(10))
    _check(K.rht_sr(x.to(DEV), signs.to(DEV), transpose, u.to(DEV), None, None, True), quantize_sr(xr, u))
    _check(K.rht_rtn(x.to(DEV), signs.to(DEV), transpose, None, True), quantize_rtn(xr))


@pytest.mark.parametrize("tile", ["1x16", "16x16"])
@pytest.mark.parametrize("transpose", [False, True])
def test_packed_source(tile, transpose):
    """Operands read straight from the saved packed form (X̂ᵀ, Ŵᵀ in backward), with the tensor
    scale applied in the kernel, as ``Factor.of(p.unpack()).dense()`` does."""
    x = _data((144, 256), seed=11)
    q = quantize_rtn_2d(x) if tile == "16x16" else quantize_rtn(x, four_over_six=True)
    p = q.pack()
    dense = (q.scaled_values() * q.tensor_scale)
    a = _logical(dense, transpose)
    h = _rot(a.shape[1])
    signs = random_signs(h, torch.Generator().manual_seed(12), "cpu")
    u = torch.rand(a.shape[0], a.shape[1] // 16, generator=torch.Generator().manual_seed(13))
    kind = kops.SRC_PACKED_2D if tile == "16x16" else kops.SRC_PACKED
    out = K.quantize_operand(p.data.to(DEV), p.scales.view(torch.uint8).to(DEV), kind, transpose,
                             p.tensor_scale.to(DEV), signs.to(DEV), None, u.to(DEV), None, 0,
                             "ms_eden", False, True, True)
    _check(out, quantize_ms_eden(rotate(a, signs), u, chunk=h))
    us = torch.rand(a.shape, generator=torch.Generator().manual_seed(14))
    out = K.quantize_operand(p.data.to(DEV), p.scales.view(torch.uint8).to(DEV), kind, transpose,
                             p.tensor_scale.to(DEV), None, None, us.to(DEV), None, 0, "sr", False, True, True)
    _check(out, quantize_sr(a, us))
    v = K.unpack(p.data.to(DEV), p.scales.to(DEV), tile == "16x16").cpu()
    assert torch.equal(_bits(v), _bits(q.scaled_values()))


@pytest.mark.parametrize("via_transpose", [False, True])
@pytest.mark.parametrize("source", ["dense", "strided", "packed", "packed_2d"])
def test_rotated_columns(source, via_transpose, monkeypatch):
    """Rotated operands read across memory rows (Eᵀ, X̂ᵀ in wgrad; Ŵᵀ in dgrad), loaded by
    row-wise slices joined in registers (``KernelTuning.sliced_sources``) or first made
    contiguous by the transpose kernel (``KernelTuning.transpose_cols``): the reference's result
    for dense, non-contiguous and packed (1×16 and 16×16) sources, with a ragged token count."""
    _tune(monkeypatch, transpose_cols=via_transpose,
          sliced_sources=() if via_transpose else ("dense", "packed", "packed_2d"))
    x = _data((160, 144), seed=31)
    signs = random_signs(16, torch.Generator().manual_seed(32), "cpu")
    u = torch.rand(144, 160, generator=torch.Generator().manual_seed(33))
    if source in ("dense", "strided"):
        wide = _data((160, 288), seed=34).to(DEV)
        src = x.to(DEV) if source == "dense" else wide[:, ::2]  # a view with both strides ≠ 1
        a = src.cpu().t()
        out = K.rht_sr(src, signs.to(DEV), True, u.to(DEV), None, None, True)
    else:
        q = quantize_rtn_2d(x) if source == "packed_2d" else quantize_rtn(x, four_over_six=True)
        p = q.pack()
        a = (q.scaled_values() * q.tensor_scale).t()
        kind = kops.SRC_PACKED_2D if source == "packed_2d" else kops.SRC_PACKED
        out = K.quantize_operand(p.data.to(DEV), p.scales.view(torch.uint8).to(DEV), kind, True,
                                 p.tensor_scale.to(DEV), signs.to(DEV), None, u.to(DEV), None, 0, "sr",
                                 False, True, True)
    _check(out, quantize_sr(rotate(a, signs), u))


@pytest.mark.parametrize("tile", [(4, 128, 1), (8, 128, 2), (16, 128, 4), (128, 16, 4), (8, 128, 1)])
def test_gpu_tile_shapes(tile, monkeypatch):
    """The tile shapes the GPU uses (one-warp 4-row tiles for MS-EDEN rows, two-warp 8-row tiles
    for the other rows, 16-row tiles for 16×16 scales and the in-kernel transpose, 16-wide column
    tiles, one-warp 8-row tiles of the sliced columns) give the reference's results too: the
    tile index arithmetic does not depend on the interpreter's large tiles, and 48×256 is
    covered by whole tiles, so the mask-free (EVEN) path runs. On the GPU these are the configs
    in use anyway."""
    if not CUDA:
        _tune(monkeypatch, tile)
    x = _data((48, 256), seed=41)
    for t in (False, True):
        a = _logical(x, t)
        h = 128 if a.shape[1] % 128 == 0 else 16
        signs = random_signs(h, torch.Generator().manual_seed(42), "cpu")
        ug = torch.rand(a.shape[0], a.shape[1] // 16, generator=torch.Generator().manual_seed(43))
        out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), t, ug.to(DEV), None, None, True)
        _check(out, quantize_ms_eden(rotate(a, signs), ug, chunk=h))
        _check(K.rtn(x.to(DEV), t, True), quantize_rtn(a, four_over_six=True))
    _check(K.rtn_2d(x.to(DEV), False, True), quantize_rtn_2d(x, four_over_six=True))


def test_sliced_sources_choose_the_column_path():
    """Which column operands take the transpose pass (``ops._transposes_first``): with
    ``sliced_sources=("dense", "packed")`` none of the dense or 1×16 packed ones under a
    whole-group quantizer, but the 16×16 packed ones do; plain RTN (not whole groups) always
    does. By default (``("dense",)``) every packed one does; with ``transpose_cols`` off none."""
    from quant.kernels.tuning import GPU_TUNING, KernelTuning

    first = kops._transposes_first
    t = KernelTuning(sliced_sources=("dense", "packed"))
    assert not first(kops.SRC_DENSE, True, True, "sr", t)
    assert not first(kops.SRC_PACKED, True, True, "ms_eden", t)
    assert first(kops.SRC_PACKED_2D, True, True, "ms_eden", t)
    assert first(kops.SRC_DENSE, True, False, "rtn", t)
    assert not first(kops.SRC_DENSE, False, True, "sr", t)  # rows never
    assert first(kops.SRC_PACKED, True, True, "ms_eden", GPU_TUNING)
    assert not first(kops.SRC_DENSE, True, True, "ms_eden", GPU_TUNING)
    assert not first(kops.SRC_PACKED, True, True, "sr", KernelTuning(transpose_cols=False))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("posthoc", [False, True])
def test_shared_eden_draws(posthoc, transpose, monkeypatch):
    """A program of four 128-column tiles in one block of 32 groups draws MS-EDEN's uniforms
    once for all four (``ops._shares_draws``, ``SHARED_U``), and they are the draws of
    ``philox_uniforms``, which computes each group's on its own: a 10×1024 operand (rows, or
    the columns of a 1024×10 tensor) has two blocks per row and a partial last row of 4-row
    tiles."""
    _tune(monkeypatch, None if CUDA else (4, 128, 1), tiles_per_program=4)
    assert kops._shares_draws(4, 128, "ms_eden", 1, 1024)
    assert not kops._shares_draws(4, 128, "ms_eden", 1, 1280)  # K % 512 != 0
    x = _data((1024, 10) if transpose else (10, 1024), seed=47)
    a = _logical(x, transpose)
    seed = torch.tensor([55555], dtype=torch.int64, device=DEV)
    signs = random_signs(128, torch.Generator().manual_seed(48), "cpu")
    u = K.philox_uniforms(seed, x.numel() // 16, "ms_eden", 3, 64).cpu().reshape(10, -1)
    out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, None, seed, None, True, stream=3,
                        posthoc=posthoc)
    _check(out, quantize_ms_eden(rotate(a, signs), u, chunk=128, posthoc=posthoc),
           posthoc=posthoc)


def test_eden_draws_need_the_row_length():
    """MS-EDEN's seeded draws depend on the row length, so ``philox_uniforms`` refuses to
    materialise them without it."""
    seed = torch.tensor([1], dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="groups = K/16"):
        K.philox_uniforms(seed, 64, "ms_eden", 0)
    with pytest.raises(ValueError, match="dividing n = 64"):
        K.philox_uniforms(seed, 64, "ms_eden", 0, 48)


@pytest.mark.parametrize("tiles", [1, 5])
def test_tiles_per_program(tiles, monkeypatch):
    """Programs that loop over several tiles (the GPU's one-warp wide-rotation tiles take 4)
    and the 2-D grid of one tile per program give the reference's bits: 48×256 in 4×128 tiles
    is 24 tiles, so 5 per program leaves a partial last program; the post hoc maximum and the
    rotated amax pass (RHT32 + SR) are reduced over each program's tiles, not taken from its
    last."""
    _tune(monkeypatch, None if CUDA else (4, 128, 1), tiles_per_program=tiles)
    x = _data((48, 256), seed=44)
    x[0, 200] = 1e4  # the tensor's maximum, in tile 1 of the first program: not its last
    seed = torch.tensor([123456789], dtype=torch.int64, device=DEV)
    signs = random_signs(128, torch.Generator().manual_seed(45), "cpu")
    u = K.philox_uniforms(seed, x.numel() // 16, "ms_eden", 2, 16).cpu().reshape(48, -1)
    out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), False, None, seed, None, True, stream=2, posthoc=True)
    _check(out, quantize_ms_eden(rotate(x, signs), u, chunk=128, posthoc=True), posthoc=True)
    signs32 = signs[:32].contiguous()
    us = torch.rand(x.shape, generator=torch.Generator().manual_seed(46))
    out = K.rht_sr(x.to(DEV), signs32.to(DEV), False, us.to(DEV), None, None, True)
    _check(out, quantize_sr(rotate(x, signs32), us))
    assert out[4].cpu() == rotate(x, signs32).abs().amax()


@pytest.mark.parametrize("tiles", [1, 5])
@pytest.mark.parametrize("transpose", [False, True])
def test_posthoc_sparse_fixes(tiles, transpose, monkeypatch):
    """Without the packed form, post hoc alignment's second pass fixes only the tiles of the
    first-pass programs whose least positive corrected scale needs it (``eden_align_kernel``
    reading ``KernelTuning.align_minima`` minima per program): two rows 2^-30 below the rest (as the query
    gradient of a sequence's first token), in the last tiles of a middle program and in the
    partial last program (48×256 in 4×128 tiles: 24 tiles, 5 per program), with 4 minima per
    align program so that the fixes fall to different align programs."""
    _tune(monkeypatch, None if CUDA else (4, 128, 1), tiles_per_program=tiles, align_minima=(4, 1))
    a = _data((48, 256), seed=49)
    a[[17, 46]] *= 2.0**-30
    x = a.t().contiguous() if transpose else a
    signs = random_signs(128, torch.Generator().manual_seed(50), "cpu")
    u = torch.rand(48, 16, generator=torch.Generator().manual_seed(51))
    ref = quantize_ms_eden(rotate(a, signs), u, chunk=128, posthoc=True)
    fixed = (ref.block_scale < 2.0**-6).any(dim=1)
    assert fixed[[17, 46]].all() and fixed.sum() <= 4  # rows 0–2 hold _data's tiny groups
    out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, u.to(DEV), None, None, False,
                        posthoc=True)
    _check(out, ref, packed=False, posthoc=True)


def test_delayed_amax_and_scaled_input():
    x = _data((48, 160), seed=15)
    prev = torch.tensor(3.5)
    out = K.rtn(x.to(DEV), False, True, prev.to(DEV))
    _check(out, quantize_rtn(x, four_over_six=True, amax=prev))
    assert out[4].cpu() == x.abs().amax()  # the current amax, for the next call
    scale = torch.tensor(0.37)
    out = K.quantize_operand(x.to(DEV), None, kops.SRC_DENSE, True, scale.to(DEV), None, None, None,
                             None, 0, "rtn", False, True, True)
    _check(out, quantize_rtn((x * scale).t()))


@pytest.mark.parametrize("has_a,has_b", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_scale_product(has_a, has_b, dtypes):
    """The GEMM epilogue kernel equals the reference's ``(acc · s_a s_b).to(dtype)`` on an FP32
    accumulator, then the cast to the output dtype, for a ragged element count."""
    dtype, out_dtype = dtypes
    g = torch.Generator().manual_seed(50)
    acc = torch.randn(37, 129, generator=g) * 1e3
    sa = torch.tensor(1.2345678e-3) if has_a else None
    sb = torch.tensor(7.654321e-2) if has_b else None
    scale = (sa if has_a else torch.ones(())) * (sb if has_b else torch.ones(()))
    ref = (acc * scale).to(dtype).to(out_dtype)
    out = K.scale_product(acc.to(DEV), None if sa is None else sa.to(DEV),
                          None if sb is None else sb.to(DEV), dtype, out_dtype).cpu()
    assert out.dtype == out_dtype and torch.equal(_bits(out), _bits(ref))


def test_zero_tensor():
    x = torch.zeros(32, 128)
    _check(K.rtn(x.to(DEV)), quantize_rtn(x))


@pytest.mark.parametrize("amax", [1e-42, 2.0**-146])
def test_tiny_tensor_scale_floor(amax):
    """Tensors whose ``amax / target`` rounds to 0 for every target (1e-42 and 2^-146, before
    or after a rotation): every kernel quantizer gives the reference's floored tensor scale
    2^-149 (SPEC §2) and its values bit for bit, all finite, on rows and columns; all-zero
    groups come out 0, not NaN."""
    x = torch.zeros(128, 256)
    x[0, 0] = amax
    x[1, 16:20] = torch.tensor([1.0, -2.0, 3.0, -5.0]) * 2.0**-149
    g = torch.Generator().manual_seed(80)
    signs = random_signs(128, g, "cpu")
    for t in (False, True):
        a = _logical(x, t)
        u, ug = torch.rand(a.shape, generator=g), torch.rand(a.shape[0], a.shape[1] // 16, generator=g)
        d, sd, s32 = x.to(DEV), signs.to(DEV), signs[:32].contiguous()
        cases = [(K.rtn(d, t, four_six), quantize_rtn(a, four_over_six=four_six), False) for four_six in (False, True)]
        cases += [(K.sr(d, t, u.to(DEV)), quantize_sr(a, u), False),
                  (K.rtn_2d(d, t, True), quantize_rtn_2d(a, four_over_six=True), False),
                  (K.rht_rtn(d, sd[:16].contiguous(), t, None, True), quantize_rtn(rotate(a, signs[:16])), False),
                  (K.rht_sr(d, s32.to(DEV), t, u.to(DEV), None, None, True), quantize_sr(rotate(a, s32), u), False)]
        for posthoc in (False, True):
            for correction in ("chunk_scaled", "energy"):
                cases.append((K.rht_ms_eden(d, sd, t, ug.to(DEV), None, None, True, posthoc=posthoc,
                                            eden_correction=correction),
                              quantize_ms_eden(rotate(a, signs), ug, posthoc=posthoc, correction=correction),
                              posthoc))
        for out, ref, posthoc in cases:
            assert ref.tensor_scale > 0 and torch.isfinite(ref.dequantize()).all()
            assert torch.isfinite(out[0].cpu().float()).all()
            _check(out, ref, posthoc=posthoc)


def _dequantized(out, posthoc=False):
    """The kernel op's dequantized ``A``: ``values · s_t`` (post hoc: the values carry s_t)."""
    values, st = out[0].cpu().float(), out[3].cpu()
    return values if posthoc else values * st


def _same_or_both_nan(a, b) -> bool:
    """Whether ``a`` and ``b`` are NaN at the same places and bit-identical elsewhere."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(_bits(a)[~na], _bits(b)[~nb])


def _non_finite_cases(x):
    """(name, kernel output, reference NVFP4Tensor, reference amax or None, post hoc) for every
    kernel quantizer on ``x``."""
    g = torch.Generator().manual_seed(70)
    signs = random_signs(128, g, "cpu")
    u = torch.rand(x.shape, generator=g)
    ug = torch.rand(x.shape[0], x.shape[1] // 16, generator=g)
    ugt = torch.rand(x.shape[1], x.shape[0] // 16, generator=g)
    xr, s32 = rotate(x, signs), signs[:32].contiguous()
    d, sd, s32d = x.to(DEV), signs.to(DEV), s32.to(DEV)
    prev = torch.tensor(2.5)  # a finite delayed amax must not hide the non-finite input
    yield "rtn", K.rtn(d), quantize_rtn(x), x.abs().amax(), False
    yield "rtn cols", K.rtn(d, True), quantize_rtn(x.t()), x.abs().amax(), False
    yield "rtn 4/6", K.rtn(d, False, True), quantize_rtn(x, four_over_six=True), x.abs().amax(), False
    yield ("rtn delayed", K.rtn(d, False, False, prev.to(DEV)), quantize_rtn(x, amax=prev),
           x.abs().amax(), False)
    yield "rtn 16x16 4/6", K.rtn_2d(d, False, True), quantize_rtn_2d(x, four_over_six=True), None, False
    yield "sr 4/6", K.sr(d, False, u.to(DEV), None, True), quantize_sr(x, u, four_over_six=True), None, False
    yield ("rht32 sr", K.rht_sr(d, s32d, False, u.to(DEV), None, None, True),
           quantize_sr(rotate(x, s32), u), rotate(x, s32).abs().amax(), False)
    yield "rht rtn", K.rht_rtn(d, sd, False, None, True), quantize_rtn(xr), xr.abs().amax(), False
    yield ("ms_eden", K.rht_ms_eden(d, sd, False, ug.to(DEV), None, None, True),
           quantize_ms_eden(xr, ug), xr.abs().amax(), False)
    for posthoc in (False, True):
        yield (f"ms_eden energy posthoc={posthoc}",
               K.rht_ms_eden(d, sd, False, ug.to(DEV), None, None, True, posthoc=posthoc,
                             eden_correction="energy"),
               quantize_ms_eden(xr, ug, posthoc=posthoc, correction="energy"),
               None if posthoc else xr.abs().amax(), posthoc)
    for pack in (True, False):
        yield (f"ms_eden posthoc pack={pack}",
               K.rht_ms_eden(d, sd, False, ug.to(DEV), None, None, pack, posthoc=True),
               quantize_ms_eden(xr, ug, posthoc=True), None, True)
    yield ("ms_eden posthoc cols", K.rht_ms_eden(d, sd, True, ugt.to(DEV), None, None, False, posthoc=True),
           quantize_ms_eden(rotate(x.t(), signs), ugt, posthoc=True), None, True)
    # a saved operand whose tensor scale is NaN (X̂ of an X holding the non-finite value)
    p = quantize_rtn(x, four_over_six=True).pack()
    a = (p.unpack().scaled_values() * p.tensor_scale).t()
    out = K.quantize_operand(p.data.to(DEV), p.scales.view(torch.uint8).to(DEV), kops.SRC_PACKED, True,
                             p.tensor_scale.to(DEV), sd, None, ugt.to(DEV), None, 0, "ms_eden", False,
                             True, True, True)
    yield "packed source ms_eden", out, quantize_ms_eden(rotate(a, signs), ugt, posthoc=True), None, True


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=str)
def test_non_finite_inputs(bad):
    """One NaN or inf in the operand (the non-finite rule of ``quant.quantizers``): every kernel
    quantizer, on rows, columns and packed sources, with and without post hoc alignment or a
    delayed amax, MS-EDEN under both corrections (a chunk holding the NaN or inf has a NaN S
    under either), dequantizes to NaN in every element with a NaN tensor scale, as the reference;
    the amax output is the reference's (NaN, or inf unrotated). (The codes and block scales of
    such a tensor are unspecified.)"""
    x = _data((128, 256), seed=71)
    x[7, 100] = bad
    for name, out, ref, ref_amax, posthoc in _non_finite_cases(x):
        assert torch.isnan(ref.tensor_scale) and torch.isnan(ref.dequantize()).all(), name
        assert torch.isnan(out[3].cpu()), name
        assert torch.isnan(_dequantized(out, posthoc)).all(), name
        if ref_amax is not None:
            assert _same_or_both_nan(out[4].cpu(), ref_amax), (name, out[4], ref_amax)


def test_non_finite_posthoc_rewrites_every_program(monkeypatch):
    """Post hoc alignment with a NaN in one first-pass program only: the align pass (with and
    without the packed form's scales) rewrites the values of every program to NaN. 16×256 in
    4×128 tiles, 5 tiles per program: two first-pass programs, the NaN in the second; one
    minimum per align program, so the first align program fixes a program with no NaN."""
    _tune(monkeypatch, None if CUDA else (4, 128, 1), tiles_per_program=5, align_minima=(1, 1))
    x = _data((16, 256), seed=72)
    x[13, 200] = math.nan
    signs = random_signs(128, torch.Generator().manual_seed(73), "cpu")
    u = torch.rand(16, 16, generator=torch.Generator().manual_seed(74))
    for pack in (False, True):
        out = K.rht_ms_eden(x.to(DEV), signs.to(DEV), False, u.to(DEV), None, None, pack, posthoc=True)
        assert torch.isnan(out[3].cpu()) and torch.isnan(_dequantized(out, True)).all(), pack


@pytest.mark.parametrize("shape", [(0, 256), (48, 0)], ids=str)
def test_empty_operands(shape):
    """Empty operands give the reference's empty results (tensor scale 1, as an all-zero
    tensor) on every quantizer, rows and columns."""
    x = torch.randn(shape)
    signs = random_signs(16, torch.Generator().manual_seed(75), "cpu")
    for t in (False, True):
        a = _logical(x, t)
        u, ug = torch.rand(a.shape), torch.rand(a.shape[0], a.shape[1] // 16)
        d = x.to(DEV)
        cases = [(K.rtn(d, t, True), quantize_rtn(a, four_over_six=True), False),
                 (K.sr(d, t, u.to(DEV)), quantize_sr(a, u), False),
                 (K.rht_rtn(d, signs.to(DEV), t, None, True), quantize_rtn(rotate(a, signs)), False),
                 (K.rtn_2d(d, t), quantize_rtn_2d(a), False)]
        for posthoc in (False, True):
            cases.append((K.rht_ms_eden(d, signs.to(DEV), t, ug.to(DEV), None, None, True, posthoc=posthoc),
                          quantize_ms_eden(rotate(a, signs), ug, chunk=16, posthoc=posthoc), posthoc))
        for out, ref, posthoc in cases:
            _check(out, ref, posthoc=posthoc)
            assert out[0].shape == a.shape and ref.tensor_scale.item() == 1.0


def test_fake_tensor_support():
    """The ops work on fake tensors (what torch.compile traces with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(64, 256, device=DEV)
        v, c, s, st, am = K.rtn(x, True, False)
        assert v.shape == (256, 64) and c.shape == (256, 32) and s.shape == (256, 4)
        v, c, s, st, am = K.rtn_2d(x)
        assert s.shape == (4, 16)
        signs = torch.empty(128, device=DEV)
        v, *_ = K.rht_ms_eden(x, signs, False, None, torch.empty(1, dtype=torch.int64, device=DEV))
        assert v.shape == (64, 256) and v.dtype == torch.bfloat16
        v, c, s, *_ = K.quantize_operand(x, None, kops.SRC_DENSE, True, None, signs, None, None,
                                         torch.empty(1, dtype=torch.int64, device=DEV), 0, "ms_eden",
                                         False, True, True, True, eden_correction="energy")
        assert v.shape == (256, 64) and c.shape == (256, 32) and s.shape == (256, 4)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("NVFP4_BACKEND", raising=False)
    assert backend.get_backend() == "auto"
    assert backend.use_triton(torch.zeros(1, device=DEV)) == CUDA
    with backend.use_backend("reference"):
        assert not backend.use_triton(torch.zeros(1, device=DEV))
    monkeypatch.setenv("NVFP4_BACKEND", "triton")
    assert backend.use_triton(torch.zeros(1))
    with pytest.raises(ValueError):
        backend.set_backend("cuda")
    monkeypatch.delenv("NVFP4_BACKEND")
    assert backend.auto_families() == backend.FAMILIES  # every family is verified on the H200
    monkeypatch.setattr(backend, "_auto_families", backend.FAMILIES)
    backend.set_auto_families(["rtn", "sr"])
    assert backend.auto_families() == ("rtn", "sr")
    assert not backend.use_triton(torch.zeros(1, device=DEV), "eden")
    with pytest.raises(ValueError, match="mx"):
        backend.set_auto_families(("rtn", "mx"))
    backend.set_auto_families(None)
    assert backend.auto_families() == backend.FAMILIES


def _run_linear(scheme, x, w, dy, autocast, layer=2):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    delayed = torch.zeros(6, device=x.device) if scheme.delayed_amax else None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        with randomness.quant_step(3, 1):
            y = quant.quantized_linear(x, w, scheme, layer, delayed)
            y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


SCHEME_CASES = [("nvidia", {}), ("four_over_six", {}), ("tetrajet_v2", {}), ("quartet2", {}),
                ("quartet2", {"range_alignment": "amax"}),
                ("quartet2", {"delayed_amax": True}), ("tetrajet_v2", {"sr_four_over_six": True}),
                ("quartet2", {"forward": False}), ("quartet2", {"eden_correction": "energy"})]


@pytest.mark.parametrize("name,kw", SCHEME_CASES)
def test_function_matches_reference(name, kw):
    """QuantizedLinearFunction with backend=triton (same uniforms) equals backend=reference, bit
    for bit: forward output and both gradients."""
    if CUDA:
        pytest.skip("bit-exact Function comparison runs on CPU (the CUDA reference divides by "
                    "reciprocals); the GPU run compares kernels one by one")
    scheme = quant.get_scheme(name, **kw)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(2, 64, 160, generator=g)
    w = torch.randn(256, 160, generator=g) * 0.05
    dy = torch.randn(2, 64, 256, generator=g)
    autocast = name == "quartet2"
    with backend.use_backend("reference"):
        ref = _run_linear(scheme, x, w, dy, autocast)
    with backend.use_backend("triton", draws="torch"):
        out = _run_linear(scheme, x, w, dy, autocast)
    for r, o, what in zip(ref, out, ("y", "dx", "dw")):
        assert r.dtype == o.dtype, what
        assert torch.equal(_bits(r), _bits(o)), f"{name}: {what} differs"


@pytest.mark.parametrize("name", ["nvidia", "four_over_six", "tetrajet_v2", "quartet2"])
def test_forward_weight_matches_reference(name):
    """``quant.linear.quantize_forward_weight`` (the Ŵ that quant/step_weights.py quantizes once
    per step, and quant/fsdp_gather.py per shard with the whole weight's amax) on the kernels
    packs the reference's codes, scales and tensor scale, with and without a given amax."""
    from quant.linear import quantize_forward_weight

    scheme = quant.get_scheme(name)
    w = torch.randn(64, 160, generator=torch.Generator().manual_seed(21)).to(DEV) * 0.05
    for amax in (None, torch.tensor(0.5, device=DEV)):
        with backend.use_backend("reference"):
            ref = quantize_forward_weight(w, scheme, amax=amax).pack()
        with backend.use_backend("triton"):
            out = quantize_forward_weight(w, scheme, amax=amax).pack()
        assert torch.equal(out.data, ref.data) and out.tile == ref.tile
        assert torch.equal(out.scales.view(torch.uint8), ref.scales.view(torch.uint8))
        assert torch.equal(out.tensor_scale.float(), ref.tensor_scale.float())


@pytest.mark.parametrize("name", ["nvidia", "quartet2"])
@pytest.mark.parametrize("where", ["nan_in_e", "inf_in_x"])
def test_function_non_finite_matches_reference(name, where):
    """QuantizedLinearFunction with backend=triton (same uniforms) puts non-finite values where
    backend=reference does (here: everywhere a quantized GEMM reads the bad tensor; dX, which
    does not read X, stays finite and bit-identical), for a NaN in the upstream gradient and an
    inf in X: nvidia (SR, 16×16 Ŵ saved packed, RHT16 + RTN of the saved X) and quartet2 (4/6,
    post hoc MS-EDEN, X̂ and Ŵ saved packed)."""
    if CUDA:
        pytest.skip("bit-exact Function comparison runs on CPU (see test_function_matches_reference)")
    scheme = quant.get_scheme(name)
    g = torch.Generator().manual_seed(23)
    x = torch.randn(128, 128, generator=g)
    w = torch.randn(128, 128, generator=g) * 0.05
    dy = torch.randn(128, 128, generator=g)
    if where == "nan_in_e":
        dy[3, 7] = math.nan
    else:
        x[3, 5] = math.inf
    with backend.use_backend("reference"):
        ref = _run_linear(scheme, x, w, dy, False)
    with backend.use_backend("triton", draws="torch"):
        out = _run_linear(scheme, x, w, dy, False)
    for r, o, what in zip(ref, out, ("y", "dx", "dw")):
        assert _same_or_both_nan(r, o), f"{name}: {what} differs"
    finite = {"nan_in_e": (True, False, False), "inf_in_x": (False, True, False)}[where]
    for t, fin in zip(out, finite):
        assert bool(torch.isfinite(t).all()) == fin and (fin or bool(t.isnan().all()))


def test_philox_stream_on_both_paths():
    """An operand drawn from a ``PhiloxStream`` gets the kernel's draws on the reference path too
    (materialised by ``philox_uniforms``): what runs when ``backend.set_auto_families`` leaves one
    operand of a GEMM to the reference. MS-EDEN with Philox signs, and SR."""
    if CUDA:
        pytest.skip("compares the reference on the same device bit for bit: CPU only")
    x = _data((64, 256), seed=60)
    key = torch.tensor([7], dtype=torch.int64)
    signs = K.philox_signs(key, 128, 3)
    cases = [(quant.get_scheme("quartet2").dgrad.a, 128, signs), (quant.get_scheme("nvidia").dgrad.a, None, None)]
    for op, rot, sg in cases:
        rng = randomness.PhiloxStream(key, 4)
        with backend.use_backend("reference"):
            ref, _ = quant.linear._quantize(Factor(x), op, sg, rng, rot, None, 0)
        with backend.use_backend("triton"):
            out, _ = quant.linear._quantize(Factor(x), op, sg, rng, rot, None, 0)
        assert torch.equal(_bits(ref.dense()), _bits(out.dense())), op.quantizer


def test_function_philox_draws_deterministic():
    """The production draw mode: a pure function of (seed, step, micro-step, layer, role); the
    layer given as an index or as the ``layer_ids`` a ``QuantLinear`` holds draws the same, and
    another layer draws otherwise (the layer is in the Philox key)."""
    scheme = quant.get_scheme("quartet2")
    g = torch.Generator().manual_seed(21)
    x = torch.randn(128, 128, generator=g, device="cpu").to(DEV)
    w = (torch.randn(128, 128, generator=g) * 0.05).to(DEV)
    dy = torch.randn(128, 128, generator=g).to(DEV)
    with backend.use_backend("triton", draws="philox"):
        a = _run_linear(scheme, x, w, dy, False)
        b = _run_linear(scheme, x, w, dy, False, layer=randomness.layer_ids(2, DEV))
        other = _run_linear(scheme, x, w, dy, False, layer=5)
    for r, o in zip(a, b):
        assert torch.equal(r, o)
    assert torch.equal(a[0], other[0])  # the forward (RTN + 4/6) draws nothing
    assert not torch.equal(a[1], other[1]) and not torch.equal(a[2], other[2])
    with backend.use_backend("reference"):
        ref = _run_linear(scheme, x.cpu(), w.cpu(), dy.cpu(), False)
    if CUDA:  # forward is deterministic; the GEMM's accumulation order differs across devices
        assert torch.allclose(a[0].cpu(), ref[0], rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(_bits(a[0].cpu()), _bits(ref[0]))
    for r, o in zip(ref[1:], a[1:]):  # backward: other draws, same estimator
        rel = (r - o.cpu()).norm() / r.norm()
        assert rel < 1.0


def test_saved_packed_operand_roundtrip():
    """The kernel path saves the same packed X̂, Ŵ as the reference (quartet2 forward)."""
    x = _data((128, 160), seed=22)
    with backend.use_backend("triton"):
        fa, qa = quant.linear._quantize(Factor(x.to(DEV)),
                                        quant.get_scheme("quartet2").forward.a, None, None, None,
                                        None, 0, pack=True)
    p, r = qa.pack(), quantize_rtn(x, four_over_six=True).pack()
    assert torch.equal(p.data.cpu(), r.data)
    assert torch.equal(p.scales.view(torch.uint8).cpu(), r.scales.view(torch.uint8))
    assert isinstance(p, PackedNVFP4) and p.tile == "1x16"


@pytest.mark.skipif(not CUDA, reason="the launch cache serves GPU launches only")
def test_launch_cache_keeps_specializations_apart():
    """Repeated launches reuse a compiled kernel (``ops._COMPILED``), and a launch that triton
    specializes differently gets its own: a view 4 bytes off 16-byte alignment, quantized right
    after an aligned tensor of the same shape, still matches the reference bit for bit (the
    kernel compiled for aligned pointers loads 16-byte vectors, which a misaligned pointer
    faults on)."""
    x = _data((64, 256))
    base = torch.cat([x.flatten(), torch.zeros(4)]).to(DEV)
    views = [base[:x.numel()].view(64, 256), base[1:1 + x.numel()].view(64, 256)]
    assert views[1].data_ptr() % 16
    for v in views + views:
        _check(K.rtn(v, False, True), quantize_rtn(v.cpu(), four_over_six=True))
    cached = len(kops._COMPILED)
    K.rtn(views[1], False, True)
    assert len(kops._COMPILED) == cached


@pytest.mark.skipif(not CUDA, reason="large-shape check of the compiled kernels")
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_large_shapes(transpose):
    x = _data((1024, 4096), seed=30, dtype=torch.bfloat16)
    a = _logical(x, transpose)
    _check(K.rtn(x.to(DEV), transpose, True), quantize_rtn(a, four_over_six=True))
    us = torch.rand(a.shape, generator=torch.Generator().manual_seed(33))
    _check(K.sr(x.to(DEV), transpose, us.to(DEV)), quantize_sr(a, us))
    s16 = random_signs(16, torch.Generator().manual_seed(34), "cpu")
    _check(K.rht_sr(x.to(DEV), s16.to(DEV), transpose, us.to(DEV), None, None, True),
           quantize_sr(rotate(a, s16), us))
    assert math.isfinite(float(K.amax(x.to(DEV))))


@pytest.mark.skipif(not CUDA, reason="large-shape check of the compiled kernels")
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_large_shapes_eden(transpose):
    x = _data((1024, 4096), seed=30, dtype=torch.bfloat16)
    a = _logical(x, transpose)
    signs = random_signs(128, torch.Generator().manual_seed(31), "cpu")
    u = torch.rand(a.shape[0], a.shape[1] // 16, generator=torch.Generator().manual_seed(32))
    for posthoc in (False, True):
        for correction in ("chunk_scaled", "energy"):
            _check(K.rht_ms_eden(x.to(DEV), signs.to(DEV), transpose, u.to(DEV), None, None, True,
                                 posthoc=posthoc, eden_correction=correction),
                   quantize_ms_eden(rotate(a, signs), u, chunk=128, posthoc=posthoc, correction=correction),
                   posthoc=posthoc)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_cuda_graph_replays_draw_per_step():
    """A captured forward + backward reads its draws from the device-side step key: replayed
    after ``set_quant_step(s)`` it gives exactly the eager result of step s (quartet2: Philox
    signs and MS-EDEN draws), and two steps differ."""
    from scripts.cuda_graph import capture

    scheme = quant.get_scheme("quartet2")
    g = torch.Generator().manual_seed(70)
    x = torch.randn(256, 256, generator=g).to(DEV).requires_grad_(True)
    w = (torch.randn(256, 256, generator=g) * 0.05).to(DEV).requires_grad_(True)
    dy = torch.randn(256, 256, generator=g).to(DEV)

    def run():
        y = quant.quantized_linear(x, w, scheme, 3)
        return torch.autograd.grad(y, (x, w), dy)

    eager = {}
    try:
        for step in (5, 6):
            randomness.set_quant_step(step)
            eager[step] = [t.clone() for t in run()]
        graph, out = capture(run)
        for step in (6, 5):
            randomness.set_quant_step(step)
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(out, eager[step]):
                assert torch.equal(a, b), step
    finally:
        randomness.set_quant_step(0)
    assert not torch.equal(eager[5][0], eager[6][0])


@pytest.mark.parametrize("name", ["nvidia", "tetrajet_v2", "quartet2"])
def test_function_compiles_as_one_graph(name):
    """Under ``torch.compile(fullgraph=True)`` (AOTAutograd, eager kernels) the Function traces
    forward and backward as one graph through the ``nvfp4::`` ops' fake implementations, and
    gives the eager result bit for bit (the draws come from the device-side step key)."""
    g = torch.Generator().manual_seed(80)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    quant.quantize_model(lin.to(DEV), name, skip=[])
    x0 = torch.randn(2, 128, 256, generator=g).to(DEV)
    randomness.step_key(x0.device)  # materialize() creates it before any compiled forward

    def run(fn):
        x = x0.clone().requires_grad_(True)
        with backend.use_backend("triton"), randomness.quant_step(4, 1):
            loss = fn(x).square().sum()
            loss.backward()
        grads = (x.grad, lin[0].weight.grad.clone())
        lin[0].weight.grad = None
        return loss.detach(), *grads

    torch._dynamo.reset()
    eager = run(lin)
    compiled = run(torch.compile(lin, backend="aot_eager", fullgraph=True))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def _tiny_quartet2(n_layer: int, compile: bool):
    """The tiny preset with ``n_layer`` blocks under quartet2 on DEV, built as train.py builds it
    (blocks compiled by ``model.parallel`` when ``compile``), and a batch of its tokens.
    Returns ``(model, tokens)``."""
    import yaml

    from model import build_model
    from model.parallel import materialize, parallelize

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/model/tiny.yaml").read_text())
    cfg["n_layer"] = n_layer
    model = build_model(cfg, device="meta")
    quant.quantize_model(model, "quartet2")
    parallelize(model, None, activation_checkpointing="none", compile=compile)
    materialize(model, torch.device(DEV), seed=0)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 65), generator=torch.Generator().manual_seed(90))
    return model, tokens.to(DEV)


def _train_step(model, tokens) -> torch.Tensor:
    """Forward under BF16 autocast and backward, on the kernel backend. Returns the loss."""
    with backend.use_backend("triton"):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss


def test_compiled_blocks_compile_once():
    """Per-block ``torch.compile`` (``model.parallel``) traces every block of a quantized model
    as one graph, without a graph break, once: the layer index reaches the Function as data
    (``QuantLinear.layer_ids``), so dynamo has no integer to specialise on. (An int layer index
    recompiled each block, and past the recompile limit of 8 the remaining blocks of a 32-layer
    model ran uncompiled; a step key made for ``cuda`` but looked up for ``cuda:0`` was created
    inside the Function and broke every block's graph.)"""
    from torch._dynamo.utils import counters

    model, tokens = _tiny_quartet2(3, compile=True)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss = _train_step(model, tokens)
    assert torch.isfinite(loss)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_blocks_keep_the_autocast_dtype():
    """Compiled quantized blocks run every GEMM, forward and backward, in the autocast dtype.
    (A branch on a tensor's strides inside the Function's backward once made the traced MLP
    GEMMs of a block run in FP32 under BF16 autocast, without an error or a graph break.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aten = torch.ops.aten
    passthrough = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
                   aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                   aten._to_copy.default, torch.ops.prims.convert_element_type.default}

    def operand_dtypes(node):
        """The dtypes an operand has on its way into the GEMM through views and casts (a GEMM
        with tensor scales widens its BF16 operands to FP32 where ``torch.mm(out_dtype=)`` has no
        kernel, i.e. on CPU)."""
        seen = set()
        while True:
            seen.add(node.meta["val"].dtype)
            if node.op != "call_function" or node.target not in passthrough:
                return seen
            node = node.args[0]

    model, tokens = _tiny_quartet2(1, compile=False)
    model.blocks[0] = torch.compile(model.blocks[0], backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                                    fullgraph=True)
    torch._dynamo.reset()
    _train_step(model, tokens)
    mm = [n for g in graphs for n in g.graph.nodes
          if n.op == "call_function" and n.target in (aten.mm.default, aten.mm.dtype)]
    assert len(graphs) == 2 and len(mm) == 12, (len(graphs), len(mm))  # 4 GEMMs forward, 8 backward
    in_dtype = [torch.bfloat16 in operand_dtypes(arg) for n in mm for arg in n.args[:2]]
    assert all(in_dtype), [(n.name, [operand_dtypes(a) for a in n.args[:2]]) for n in mm]


def test_compiled_backward_reads_one_e():
    """Under inductor both backward GEMMs of a quantized linear read one buffer of E (dgrad's E
    and wgrad's Eᵀ as views of it): ``nvfp4::quantize_operand`` takes inputs of any layout.
    (Under inductor's default constraint for custom ops, exact strides, the E of the linears
    that feed the residual stream, a BF16 cast of its FP32 gradient, was written twice, one
    copy per quantization.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    model, tokens = _tiny_quartet2(1, compile=True)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # its key leaves out the ops' tags
        _, codes = run_and_get_code(_train_step, model, tokens)
    e_buffers = [m.group(1) for code in codes for m in re.finditer(
        r"quantize_operand\.default\((?:reinterpret_tensor\()?(\w+)[^\n]*?, None, 0, [^\n]*'ms_eden'", code)]
    assert len(e_buffers) == 8 and len(set(e_buffers)) == 4, e_buffers  # 4 linears: E, Eᵀ each
