"""One autograd Function that executes any :class:`~quant.schemes.Scheme`, and model conversion.

Each GEMM ``A · Bᵀ`` (forward ``X Wᵀ``, dgrad ``E W``, wgrad ``Eᵀ X``; SPEC §3) runs as:

1. take each operand from its source: the high-precision tensor, or the forward's quantized
   tensor that the layer saved in packed NVFP4 form (4.5 bits per value);
2. if the GEMM rotates, draw shared random signs and rotate both operands along the reduction
   dimension (SPEC §2, MS-EDEN step 1);
3. quantize each operand along the reduction dimension with its quantizer;
4. multiply the exact ``q · s_block`` values (exact in BF16 too) accumulating in FP32, multiply
   the FP32 sum by the product of the two FP32 tensor scales in FP32, and round once to the
   compute dtype (:func:`_product`), as the NVFP4 GEMM's epilogue does (``α = s_A · s_B``,
   ``D = round(α · acc)``; cuBLASLt, and :mod:`quant.native.scaled_mm_sim`). An operand under post hoc
   range alignment (SPEC §2), whose tensor scale is a power of two, carries it in its values,
   ``(q · s_block) · s_tensor``: the same product as long as the values stay in BF16's normal
   range (above 2^-126), and the kernels then write the values in their first pass
   (``quant.kernels.triton_kernels``).

Emulation therefore differs from a real NVFP4 GEMM only in accumulation order. Random draws come
from :mod:`quant.randomness`, keyed by (seed, step, micro-step, layer, role, rank).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import backend, randomness
from .factor import Factor
from .format import GROUP, NVFP4Tensor, PackedNVFP4
from .gathered import GatheredNVFP4Weight
from .hadamard import random_signs, rotate
from .quantizers import amax_of, quantize_ms_eden, quantize_rtn, quantize_rtn_2d, quantize_sr
from .randomness import PhiloxStream
from .schemes import Gemm, Operand, Scheme, get_scheme

# Slots of the delayed-amax buffer: (GEMM, operand) → index.
_AMAX_SLOT = {("forward", "a"): 0, ("forward", "b"): 1, ("dgrad", "a"): 2,
              ("dgrad", "b"): 3, ("wgrad", "a"): 4, ("wgrad", "b"): 5}


def _amax(x: torch.Tensor, delayed: torch.Tensor | None, slot: int) -> torch.Tensor | None:
    """Delayed amax (SPEC §3 ablation): use the previous call's amax, store the current one.

    A previous amax that is 0 (the first call) or non-finite (a call that saw NaN or ±inf) is
    not reused: the current one is. (A non-finite current amax wins over the previous one in
    the quantizer, :func:`~quant.quantizers.amax_of`.)"""
    if delayed is None:
        return None
    current = amax_of(x)
    previous = delayed[slot].clone()
    delayed[slot] = current
    return torch.where((previous > 0) & (previous < math.inf), previous, current)


def uniforms(rng: torch.Generator | PhiloxStream, shape: tuple[int, ...], mode: str,
             device: torch.device) -> torch.Tensor:
    """The FP32 uniforms of one stochastic operand: SR's (``mode="sr"``, one per element) or
    MS-EDEN's (``"ms_eden"``, one per 16-group), drawn from a generator, or the very numbers the
    kernels draw from a :class:`~quant.randomness.PhiloxStream`."""
    if isinstance(rng, PhiloxStream):
        from .kernels import ops

        return ops.philox_uniforms(rng.key, math.prod(shape), mode, rng.stream,
                                   shape[-1] if mode == "ms_eden" else 0).reshape(shape)
    return torch.rand(shape, generator=rng, device=device)


def _quantize(
    src: Factor,
    op: Operand,
    signs: torch.Tensor | None,
    rng: torch.Generator | PhiloxStream | None,
    rotation: int | None,
    delayed: torch.Tensor | None,
    slot: int,
    pack: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[Factor, NVFP4Tensor | None]:
    """Rotate (if ``signs``) and quantize one operand along its last dim, drawing from ``rng``.
    ``amax``: the tensor amax when the caller knows it (a shard of a tensor whose amax was
    all-reduced, :mod:`quant.fsdp_gather`), else the operand's own (or its delayed one).

    On the Triton backend (:mod:`quant.backend`) the fused kernels do it (same draws; the
    packed form is produced in the same pass when ``pack``)."""
    if op.quantizer == "none" and signs is None:
        return src, None
    family = ("eden" if op.quantizer == "ms_eden" else "rht" if signs is not None
              else "sr" if op.quantizer == "sr" else "rtn")
    if type(src) is not Factor or backend.use_triton(src.values, family):
        from .kernels.dispatch import quantize_factor

        return quantize_factor(src, op, signs, rng, rotation, delayed, slot, pack, amax)
    x = src.dense()
    if signs is not None:
        x = rotate(x, signs)
    if op.quantizer == "none":
        return Factor(x), None
    if amax is None and not op.posthoc:  # post hoc alignment needs no amax
        amax = _amax(x, delayed, slot)
    if op.quantizer == "rtn":
        q = quantize_rtn(x, four_over_six=op.four_over_six, amax=amax)
    elif op.quantizer == "rtn_2d":
        q = quantize_rtn_2d(x, four_over_six=op.four_over_six, amax=amax)
    elif op.quantizer == "sr":
        u = uniforms(rng, tuple(x.shape), "sr", x.device)
        q = quantize_sr(x, u, amax=amax, four_over_six=op.four_over_six)
    else:  # ms_eden
        u = uniforms(rng, (*x.shape[:-1], x.shape[-1] // GROUP), "ms_eden", x.device)
        q = quantize_ms_eden(x, u, chunk=rotation, amax=amax, posthoc=op.posthoc, correction=op.eden_correction)
        if op.posthoc:  # a power-of-two tensor scale: the values carry it (step 4 below)
            return Factor(q.dequantize()), q
    return Factor.of(q), q


def quantize_forward_weight(
    weight: torch.Tensor, scheme: Scheme, delayed_amax: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor | None:
    """Ŵ: the weight operand of the forward GEMM ``Y = X Ŵᵀ`` exactly as a :class:`QuantLinear`
    under ``scheme`` quantizes it (SPEC §3, the "forward X / W" column; the code path of the
    layer's forward), or None when the scheme leaves the forward weight in high precision. On
    the kernel backend it is the kernels' packed output, which offers the same ``pack()``.

    SPEC §3 quantizes the forward weight deterministically (RTN 1×16, RTN 16×16, with or
    without 4/6; no rotation, no random draw), so Ŵ is a function of ``weight`` alone, and of
    the layer's ``delayed_amax`` buffer under the delayed-amax ablation, which is read here and
    not updated. ``amax``: the amax of the whole weight when ``weight`` is a block of its rows
    (the tensor scale of SPEC §2 is the whole tensor's), which then quantizes as those rows of
    the whole weight do."""
    delayed = None if delayed_amax is None else delayed_amax.detach().clone()
    _, q = _quantize(Factor(weight.detach()), scheme.forward.b, None, None, None, delayed,
                     _AMAX_SLOT["forward", "b"], pack=True, amax=amax)
    return q


def _fp32_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a · bᵀ`` of the operands in ``dtype`` (exact for quantized values), accumulated and
    returned in FP32. On CUDA, BF16/FP16 operands run on the tensor cores with an FP32 output
    (``torch.mm(out_dtype=)``); elsewhere, where that has no kernel, they are widened to FP32."""
    a, b = a.to(dtype), b.to(dtype)
    if a.is_cuda and dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return F.linear(a.float(), b.float())


def _product(a: Factor, b: Factor, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(a.values · b.valuesᵀ) · (a.scale · b.scale)`` rounded once to ``dtype``, returned in
    ``out_dtype`` (default ``dtype``; a wider one holds the rounded value exactly).

    What NVFP4 hardware computes (cuBLASLt's block-scaled GEMM, simulated by
    :func:`quant.native.scaled_mm_sim.simulate_scaled_mm`): the products of the exact ``q · s_block``
    values summed in FP32, ``α = s_A · s_B`` in FP32, ``α · acc`` in FP32, one rounding to the
    output dtype. This function computes the same, and differs only in the order of the FP32
    accumulation (cuBLAS's or the CPU's, not the tensor cores' K-blocked order). Without tensor
    scales (high-precision operands, or post hoc operands whose values carry their scale) the
    GEMM rounds once itself. Eager, on the kernel backend, the epilogue and the cast are one
    pass (``quant.kernels.scale_product``); under ``torch.compile`` they stay torch ops, which
    inductor fuses into the kernels that consume the product (an RMSNorm, SwiGLU, the residual
    add)."""
    out_dtype = out_dtype or dtype
    if a.scale is None and b.scale is None:
        return F.linear(a.values.to(dtype), b.values.to(dtype)).to(out_dtype)
    acc = _fp32_product(a.values, b.values, dtype)
    if backend.use_triton(acc) and not torch.compiler.is_compiling():
        from .kernels import ops

        return ops.scale_product(acc, a.scale, b.scale, dtype, out_dtype)
    one = torch.ones((), device=acc.device)
    scale = (a.scale if a.scale is not None else one) * (b.scale if b.scale is not None else one)
    return (acc * scale).to(dtype).to(out_dtype)


def quantized_gemm(
    a: Factor,
    b: Factor,
    gemm: Gemm,
    role: str,
    layer: torch.Tensor,
    dtype: torch.dtype,
    delayed: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    b_quantized: PackedNVFP4 | None = None,
) -> tuple[torch.Tensor, NVFP4Tensor | PackedNVFP4 | None, NVFP4Tensor | PackedNVFP4 | None]:
    """``A · Bᵀ`` under one GEMM's quantization. Returns the product (computed in ``dtype``,
    returned in ``out_dtype``, default ``dtype``) and the quantized operands.

    ``b_quantized``: B already quantized by ``gemm.b`` (a deterministic quantizer: the forward's
    Ŵ of this optimizer step, :mod:`quant.step_weights`), used as it is.

    Draws (:mod:`quant.randomness`; ``layer`` is the layer's :func:`~quant.randomness.layer_ids`):
    on the kernel path with Philox draws (the default), the signs and each operand's uniforms
    come from their own stream under the layer key; otherwise from the (layer, role) generator
    in the order rotation signs, A's uniforms, B's.
    """
    device = a.values.device
    rng_a = rng_b = signs = None
    if gemm.stochastic and backend.get_draws() == "philox" and backend.use_triton(a.values):
        from .kernels import ops

        key = randomness.layer_key(layer)
        rng_a = PhiloxStream(key, randomness.stream(role, "a"))
        rng_b = PhiloxStream(key, randomness.stream(role, "b"))
        if gemm.rotation:
            signs = ops.philox_signs(key, gemm.rotation, randomness.stream(role, "signs"))
    elif gemm.stochastic:
        rng_a = rng_b = randomness.generator(int(layer[0]), role, device)
        signs = random_signs(gemm.rotation, rng_a, device) if gemm.rotation else None
    native = dtype == torch.bfloat16 and backend.use_native(a.values)
    # The forward's quantized operands are what the layer may save; native GEMMs read all packed.
    pack = role == "forward" or native
    fa, qa = _quantize(a, gemm.a, signs, rng_a, gemm.rotation, delayed, _AMAX_SLOT[role, "a"], pack)
    if b_quantized is None:
        fb, qb = _quantize(b, gemm.b, signs, rng_b, gemm.rotation, delayed, _AMAX_SLOT[role, "b"], pack)
    else:
        fb, qb = _saved_factor(b_quantized), b_quantized
    if native:
        pa, pb = _native_operand(fa, qa), _native_operand(fb, qb)
        if pa is not None and pb is not None:
            from . import native as nvfp4

            return nvfp4.gemm(pa, pb, dtype, out_dtype), qa, qb
    return _product(fa, fb, dtype, out_dtype), qa, qb


def _native_operand(f, q) -> PackedNVFP4 | None:
    """The packed NVFP4 form of a GEMM factor along its last dim, for a native GEMM: the
    operand just quantized (``q``), or a saved packed operand used as it is (transposed when
    the factor is its transpose, which 16×16 tiles allow; :meth:`PackedNVFP4.transposed`).
    None when the factor is not NVFP4 (high precision, or a 1×16 tensor read across its
    groups): the GEMM then runs emulated."""
    if q is not None:
        return q.pack()
    packed = getattr(f, "packed", None)
    if packed is None or not getattr(f, "transposed", False):
        return packed
    return packed.transposed() if packed.tile == "16x16" else None


def _saved_factor(p: PackedNVFP4) -> Factor:
    """A saved packed operand as a factor: unpacked by the reference, or read packed by the
    kernels (:class:`quant.kernels.dispatch.PackedFactor`)."""
    if backend.use_triton(p.data, "packed"):
        from .kernels.dispatch import saved_factor

        return saved_factor(p)
    return replace(Factor.of(p.unpack()), packed=p)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class QuantizedLinearFunction(torch.autograd.Function):
    """``Y = X Wᵀ`` under a scheme; X may have any leading batch dims.

    Saves for backward what the scheme says: X in high precision or X̂ packed, and Ŵ packed
    when dgrad reuses the forward's quantized weight (W itself is a parameter, kept anyway).
    ``w_data``, ``w_scales``, ``w_scale``, ``w_tile``: the packed Ŵ of this optimizer step
    (:mod:`quant.step_weights`), used instead of quantizing W again; None: W is quantized here.
    """

    @staticmethod
    def forward(ctx, x, weight, scheme: Scheme, layer: torch.Tensor, delayed_amax,  # type: ignore[override]
                w_data=None, w_scales=None, w_scale=None, w_tile=None):
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        step_w = None if w_data is None else PackedNVFP4(w_data, w_scales, w_scale, -1, w_tile)
        with torch.autocast(x.device.type, enabled=False):
            y, xq, wq = quantized_gemm(
                Factor(x2), Factor(weight), scheme.forward, "forward", layer, dtype, delayed_amax,
                b_quantized=step_w,
            )
        packed = {}
        if scheme.saves_quantized_x and xq is not None:
            packed["x"] = xq.pack()
        if scheme.saves_quantized_w and wq is not None:
            packed["w"] = wq.pack()
        ctx.scheme, ctx.dtype = scheme, dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.delayed_amax = delayed_amax
        ctx.packed_meta = {k: (p.dim, p.tile) for k, p in packed.items()}
        saved_x = x2 if "x" not in packed else None
        flat = [t for p in packed.values() for t in (p.data, p.scales, p.tensor_scale)]
        ctx.save_for_backward(layer, saved_x, weight, *flat)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        scheme: Scheme = ctx.scheme
        layer, x2, weight, *flat = ctx.saved_tensors
        packed = {
            k: PackedNVFP4(*flat[3 * i: 3 * i + 3], *meta)
            for i, (k, meta) in enumerate(ctx.packed_meta.items())
        }
        x_src = _saved_factor(packed["x"]) if "x" in packed else Factor(x2)
        w_src = _saved_factor(packed["w"]) if "w" in packed else Factor(weight)
        e = grad_out.reshape(-1, grad_out.shape[-1])
        dx = dw = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx, _, _ = quantized_gemm(
                    Factor(e), w_src.T, scheme.dgrad, "dgrad", layer, ctx.dtype,
                    ctx.delayed_amax, ctx.x_dtype,
                )
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                dw, _, _ = quantized_gemm(
                    Factor(e.t()), x_src.T, scheme.wgrad, "wgrad", layer, ctx.dtype,
                    ctx.delayed_amax, weight.dtype,
                )
        return dx, dw, None, None, None, None, None, None, None


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scheme: Scheme,
    layer: int | torch.Tensor = 0,
    delayed_amax: torch.Tensor | None = None,
    step_weight: PackedNVFP4 | None = None,
) -> torch.Tensor:
    """Functional form of :class:`QuantizedLinearFunction` (no bias). ``layer``: the layer
    index, or its :func:`~quant.randomness.layer_ids` on ``x``'s device (what
    :class:`QuantLinear` passes: data, so compiled blocks don't specialise on it).
    ``step_weight``: the forward's Ŵ of this optimizer step (:mod:`quant.step_weights`)."""
    if not isinstance(layer, torch.Tensor):
        layer = randomness.cached_layer_ids(layer, x.device)
    if step_weight is None:
        return QuantizedLinearFunction.apply(x, weight, scheme, layer, delayed_amax)
    return QuantizedLinearFunction.apply(x, weight, scheme, layer, delayed_amax, step_weight.data,
                                         step_weight.scales, step_weight.tensor_scale, step_weight.tile)


def check_linear_shape(name: str, in_features: int, out_features: int, scheme: Scheme) -> None:
    """Refuse layers whose dimensions the scheme cannot group or rotate, naming layer and fix."""
    needs = []
    if scheme.forward.quantized:
        needs.append(("in_features", in_features, GROUP, "the forward GEMM groups along in-features"))
    if scheme.forward.b.quantizer == "rtn_2d":
        needs.append(("out_features", out_features, GROUP, "the weight is quantized in 16×16 tiles"))
    if scheme.dgrad.quantized or scheme.dgrad.rotation:
        size = max(GROUP, scheme.dgrad.rotation or 1)
        needs.append(("out_features", out_features, size,
                      f"dgrad groups{' and rotates' if scheme.dgrad.rotation else ''} along out-features"))
    if scheme.wgrad.quantized:
        needs.append(("in_features", in_features, GROUP, "wgrad's operand Xᵀ has in-features as rows"))
    for what, n, size, why in needs:
        if n % size:
            raise ValueError(
                f"layer {name!r} (Linear {in_features}→{out_features}) cannot use scheme "
                f"{scheme.name!r}: {what}={n} is not divisible by {size} ({why}). Fix: resize the "
                f"layer to a multiple of {size}, choose a smaller rotation (quant.rotation=...), "
                f"or keep it in high precision with quant.skip=['{name}']."
            )


def token_multiple(scheme: Scheme) -> int:
    """What the token count must divide by: wgrad groups (and rotates) along tokens (1: any)."""
    if not (scheme.wgrad.quantized or scheme.wgrad.rotation):
        return 1
    return max(GROUP, scheme.wgrad.rotation or 1)


def check_token_count(name: str, tokens: int, scheme: Scheme) -> None:
    """wgrad groups (and rotates) along tokens: the token count must divide accordingly."""
    size = token_multiple(scheme)
    if tokens % size:
        raise ValueError(
            f"layer {name!r}: scheme {scheme.name!r} quantizes the weight gradient along tokens, "
            f"so the tokens per micro-batch (batch × sequence length = {tokens}) must be "
            f"divisible by {size}. Fix: change the micro-batch size or the sequence length."
        )


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run under a quantization scheme (same parameters and
    state-dict keys as ``nn.Linear``, so checkpoints load into either)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        scheme: Scheme,
        layer_index: int = 0,
        name: str = "",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        check_linear_shape(name, in_features, out_features, scheme)
        self.scheme, self.layer_index, self.layer_name = scheme, layer_index, name
        # The layer's identity for the random draws, as data (quant.randomness.layer_ids).
        self.register_buffer("layer_ids", randomness.layer_ids(layer_index, device), persistent=False)
        if scheme.delayed_amax:
            self.register_buffer("delayed_amax", torch.zeros(6, device=device))
        else:
            self.delayed_amax = None
        # The forward's Ŵ while an optimizer step runs (quant.step_weights), else None. Under
        # FSDP2 with parallel.weight_gather=nvfp4 the gathered weight is Ŵ (quant.fsdp_gather).
        self.step_weight: PackedNVFP4 | None = None

    def reset_buffers(self) -> None:
        """Refill the buffers (after ``to_empty``): the layer ids and a zero delayed amax."""
        self.layer_ids.copy_(randomness.layer_ids(self.layer_index))
        if self.delayed_amax is not None:
            self.delayed_amax.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        if tokens % token_multiple(self.scheme):  # the name only here: compiled blocks don't guard it
            check_token_count(self.layer_name, tokens, self.scheme)
        w, step_weight = self.weight, self.step_weight
        if isinstance(w, GatheredNVFP4Weight):  # FSDP2 gathered Ŵ (quant.fsdp_gather)
            if w.serves(self.scheme.forward.b):
                step_weight = w.packed
            else:  # this layer's GEMMs now read W itself (a precision switch, BF16 validation)
                w = _whole_weight(w)
        y = quantized_linear(x, w, self.scheme, self.layer_ids, self.delayed_amax, step_weight)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme.name}, layer={self.layer_index}"


@torch.compiler.disable
def _whole_weight(w: GatheredNVFP4Weight) -> torch.Tensor:
    """W from an NVFP4-gathered weight's shards (a collective: outside compiled graphs)."""
    return w.whole()


def edge_block_patterns(n_layer: int, first: int = 2, last: int = 8, prefix: str = "blocks") -> list[str]:
    """Skip patterns that keep the first ``first`` and last ``last`` blocks in high precision
    (NVIDIA's recipe at 12B scale, SPEC §3)."""
    idx = sorted(set(range(min(first, n_layer))) | set(range(max(0, n_layer - last), n_layer)))
    return [f"{prefix}.{i}.*" for i in idx]


def skip_patterns_by_key(quant_cfg: Mapping[str, Any], n_layer: int,
                         default: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(config key, pattern)`` for each module pattern a quant config (configs/quant/) keeps in
    high precision: its ``skip`` (``default`` when absent or null: the scheme's own, for the config
    of a run) and ``keep_edge_blocks``'s first and last blocks (:func:`edge_block_patterns`)."""
    skip = quant_cfg["skip"] if quant_cfg.get("skip") is not None else default
    patterns = [("quant.skip", p) for p in skip]
    edges = quant_cfg.get("keep_edge_blocks")
    if edges:
        patterns += [("quant.keep_edge_blocks", p)
                     for p in edge_block_patterns(n_layer, edges["first"], edges["last"])]
    return patterns


def skip_patterns(quant_cfg: Mapping[str, Any], n_layer: int, default: Sequence[str] = ()) -> list[str]:
    """The patterns of :func:`skip_patterns_by_key`, in its order."""
    return [p for _, p in skip_patterns_by_key(quant_cfg, n_layer, default)]


def quantize_model(
    model: nn.Module, scheme: Scheme | str, skip: list[str] | tuple[str, ...] | None = None
) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`QuantLinear`.

    Args:
        scheme: a :class:`Scheme` or a scheme name.
        skip: ``fnmatch`` patterns of qualified module names kept in high precision; defaults to
            the scheme's ``skip`` (``lm_head``). The identity scheme (``bf16``) converts nothing.

    Layers are numbered in module order for the randomness key. Weights are moved, not copied.
    Raises a ValueError naming the layer when a dimension doesn't fit the scheme.
    """
    if isinstance(scheme, str):
        scheme = get_scheme(scheme)
    patterns = tuple(scheme.skip if skip is None else skip)
    if scheme.is_identity:
        return model
    targets = [
        (name, mod) for name, mod in model.named_modules()
        if type(mod) is nn.Linear and not any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
    for index, (name, lin) in enumerate(targets):
        q = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, scheme=scheme,
                        layer_index=index, name=name, device="meta")
        q.weight, q.bias = lin.weight, lin.bias
        q.layer_ids = randomness.layer_ids(index, lin.weight.device)
        if q.delayed_amax is not None:
            q.delayed_amax = torch.zeros(6, device=lin.weight.device)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, q)
    return model
