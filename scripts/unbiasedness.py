"""Concentration study of the quantized backward pass (SPEC §5, "Unbiasedness").

    python scripts/unbiasedness.py                               # tiny model, block 0 attn.qkv, B ≤ 1024
    python scripts/unbiasedness.py --model 30m --max-b 1024 --out-dir unbiasedness/30m
    python scripts/unbiasedness.py --model runs/x/model.pt --layers blocks.0.attn.qkv blocks.3.mlp.down
    python scripts/unbiasedness.py --operands 2000 --distribution heavy   # the quantizers' direct bias test

Protocol. One model (a preset of configs/model/, randomly initialised with ``--seed``; or a
consolidated checkpoint written by scripts/export_checkpoint.py), one fixed batch of tokens (random
ids, or the first validation batch of a prepared dataset with ``--data DIR``) and its
cross-entropy loss. For every scheme only the backward pass is quantized
(``get_scheme(name, forward=False)``): the forward is exact, so the logits and the loss's gradient
with respect to them (the upstream gradient) are the same fixed tensors for every draw, and the
exact reference gradient ``G`` is the gradient of the same model with quantization off. One forward
graph per scheme is kept (``retain_graph=True``) and differentiated ``max_b`` times; before draw
``i`` the quantizers' counter is set to step ``i`` (``quant_step(i)``), so every draw is fresh and
reproducible. For B = 1, 4, 16, …, ``--max-b`` the script reports, for each chosen layer's weight
gradient, the relative squared error of the mean of the first B draws,

    err(B) = ‖ mean_{i≤B} Ĝ_i − G ‖² / ‖G ‖²,

its least-squares log-log slope against B (−1 for an unbiased estimator: +1 bit per 4× B), and a
direct bias check at the largest B: the mean over the gradient's elements of
``z² = B · (mean Ĝ − G)² / s²`` (s² the elements' sample variance over the B draws). An unbiased
estimator gives z² ≈ 1 at any B; a bias gives z² growing in proportion to B. (SPEC §5: a slope alone
can miss a mild bias, so read both.)

Schemes (``--schemes``): any name of quant.SCHEMES, and ``NAME+sr46`` for the scheme with 4/6
selection on its stochastic-rounding operands (``sr_four_over_six=True``), the biased control.
Default: nvidia, four_over_six, tetrajet_v2, quartet2 and nvidia+sr46.

Outputs: a markdown table on stdout (and ``OUT_DIR/unbiasedness.md``), ``OUT_DIR/unbiasedness.png``
(log-log, one panel per layer, with a 1/B reference line) and ``OUT_DIR/unbiasedness.json``.
``--operands DRAWS`` runs the direct bias test of the quantizers and of quartet2's GEMM instead
(:func:`operand_study`: along the target and on random directions, analysis.bias) on fixed
Gaussian, heavy-tailed or a model's wgrad operands (``--distribution``).

Computation is FP32 (no autocast), on ``--device`` (CPU by default). Only the chosen weights require
gradients, so each draw back-propagates from the loss down to the chosen layers and computes no
other weight gradient.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import quant
from analysis.bias import DIRECTIONS, P_FLAG, Z_FLAG, BiasStat, DirectionalBias, EstimatorBias, estimator_bias
from model import build_model
from model.llama import Llama
from quant.hadamard import random_signs, rotate, unrotate
from quant.quantizers import quantize_ms_eden, quantize_rtn, quantize_sr

REPO = Path(__file__).resolve().parents[1]

DEFAULT_SCHEMES = ["nvidia", "four_over_six", "tetrajet_v2", "quartet2", "nvidia+sr46"]
DEFAULT_LAYERS = ["blocks.0.attn.qkv"]
CONTROL_SUFFIX = "+sr46"


class StudyError(ValueError):
    """A bad argument; the message says how to fix it."""


def scheme_of(spec: str) -> quant.Scheme:
    """``NAME`` or ``NAME+sr46``, with backward-only quantization."""
    name, control = (spec[: -len(CONTROL_SUFFIX)], True) if spec.endswith(CONTROL_SUFFIX) else (spec, False)
    if name not in quant.SCHEMES:
        raise StudyError(f"unknown scheme {spec!r}; choose from {sorted(quant.SCHEMES)}, optionally with "
                         f"'{CONTROL_SUFFIX}' for the biased 4/6-on-SR control (e.g. nvidia{CONTROL_SUFFIX})")
    scheme = quant.get_scheme(name, forward=False, sr_four_over_six=control)
    if scheme.is_identity:
        raise StudyError(f"scheme {spec!r} quantizes nothing in the backward pass; nothing to study")
    return scheme


def scheme_label(spec: str) -> str:
    if spec.endswith(CONTROL_SUFFIX):
        return f"{spec[: -len(CONTROL_SUFFIX)]}+4/6-on-SR (biased control)"
    return spec


def load_model(spec: str, seed: int, device: str) -> tuple[Llama, dict, str]:
    """A preset name (``configs/model/<name>.yaml``, random init) or a consolidated checkpoint."""
    path = Path(spec)
    if path.suffix in (".pt", ".pth") or path.is_file():
        if not path.is_file():
            raise StudyError(f"checkpoint {path} not found. Fix: export one with "
                             f"python scripts/export_checkpoint.py runs/<run>/checkpoints/step_N {path}")
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
            raise StudyError(f"{path} is not a consolidated checkpoint of scripts/export_checkpoint.py "
                             f"(expected a dict with 'model' and 'config')")
        cfg = dict(ckpt["config"]["model"])
        model = build_model(cfg, device=device)
        model.load_state_dict(ckpt["model"])
        return model, cfg, f"{path} (step {ckpt.get('step')})"
    preset = REPO / "configs" / "model" / f"{spec}.yaml"
    if not preset.is_file():
        names = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml"))
        raise StudyError(f"no model preset {spec!r} and no checkpoint file of that name; presets: {names}")
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(preset), resolve=True)
    torch.manual_seed(seed)
    model = build_model(cfg, device=device)
    return model, cfg, f"preset {spec} (random init, seed {seed})"


def fixed_batch(cfg: dict, batch: int, seq_len: int, seed: int, data: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    if seq_len > cfg["max_seq_len"]:
        raise StudyError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg['max_seq_len']}")
    if data is not None:
        from data.loader import val_batches

        x, y = next(iter(val_batches(data, seq_len, batch, 1)))
        if int(max(x.max(), y.max())) >= cfg["vocab_size"]:
            raise StudyError(f"token ids of {data} exceed the model's vocabulary ({cfg['vocab_size']})")
        return x, y
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def resolve_layers(model: Llama, names: list[str]) -> list[str]:
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    block_linears = [n for n in linears if n.startswith("blocks.")]
    for n in names:
        if n not in linears:
            raise StudyError(f"no linear layer {n!r}; block linears are e.g. {block_linears[:4]} "
                             f"(blocks.<i>.attn.qkv|attn.proj|mlp.up_gate|mlp.down)")
        if n not in block_linears:
            raise StudyError(f"{n!r} is not quantized by any scheme (only block linears are); "
                             f"choose one of blocks.<i>.attn.qkv|attn.proj|mlp.up_gate|mlp.down")
    return names


def b_values(max_b: int, ratio: int) -> list[int]:
    if max_b < 1 or ratio < 2:
        raise StudyError("--max-b must be ≥ 1 and --ratio ≥ 2")
    bs, b = [], 1
    while b <= max_b:
        bs.append(b)
        b *= ratio
    if bs[-1] != max_b:
        bs.append(max_b)
    return bs


def loglog_slope(bs: list[int], errs: list[float]) -> float:
    """Least-squares slope of log(err) against log(B)."""
    pts = [(math.log(b), math.log(e)) for b, e in zip(bs, errs) if e > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


@dataclass
class Curve:
    scheme: str
    layer: str
    bs: list[int]
    errors: list[float]
    slope: float
    z2: float | None  # mean squared z-score of the mean at the largest B
    bias2: float | None  # estimated ‖E Ĝ − G‖² / ‖G‖²: err(B) minus the variance share, at the largest B
    bias: BiasStat | None = None  # the direct statistic along G over all draws (analysis.bias)
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _weights(model: Llama, layers: list[str]) -> list[torch.Tensor]:
    for p in model.parameters():
        p.requires_grad_(False)
    ws = [model.get_submodule(n).weight for n in layers]
    for w in ws:
        w.requires_grad_(True)
    return ws


def _loss(model: Llama, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def study(
    model: Llama,
    x: torch.Tensor,
    y: torch.Tensor,
    schemes: list[str],
    layers: list[str],
    max_b: int,
    ratio: int = 4,
    seed: int = 0,
    log=print,
) -> list[Curve]:
    """err(B) per scheme and layer (see the module docstring)."""
    for s in schemes:
        scheme_of(s)  # fail on a bad name before any work
    resolve_layers(model, layers)
    bs = b_values(max_b, ratio)
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)

    exact_model = copy.deepcopy(model)
    ws = _weights(exact_model, layers)
    exact = [g.double() for g in torch.autograd.grad(_loss(exact_model, x, y), ws)]
    norms = [g.square().sum().item() for g in exact]
    for n, layer in zip(norms, layers):
        if n == 0:
            raise StudyError(f"the exact gradient of {layer} is zero on this batch; choose another layer")
    del exact_model

    curves = []
    quant.set_quant_rng(seed=seed, rank=0)
    for spec in schemes:
        t0 = time.perf_counter()
        qmodel = copy.deepcopy(model)
        quant.quantize_model(qmodel, scheme_of(spec))
        ws = _weights(qmodel, layers)
        loss = _loss(qmodel, x, y)  # exact forward: the same graph serves every draw
        sums = [torch.zeros_like(g) for g in exact]
        squares = [torch.zeros_like(g) for g in exact]
        errors: list[list[float]] = [[] for _ in layers]
        directional = [DirectionalBias(g) for g in exact]
        for i in range(1, max_b + 1):
            with quant.quant_step(i):
                grads = torch.autograd.grad(loss, ws, retain_graph=i < max_b)
            for k, g in enumerate(grads):
                g = g.double()
                directional[k].add(g)
                sums[k] += g
                squares[k] += g * g
                if i in bs:
                    errors[k].append((sums[k] / i - exact[k]).square().sum().item() / norms[k])
        seconds = time.perf_counter() - t0
        for k, layer in enumerate(layers):
            z2 = bias2 = None
            if max_b >= 4:
                mean = sums[k] / max_b
                var = ((squares[k] - max_b * mean * mean) / (max_b - 1)).clamp_min(0)
                ok = var > 1e-12 * var.max().clamp_min(1e-300)
                z2 = (max_b * (mean - exact[k]).square()[ok] / var[ok]).mean().item()
                bias2 = errors[k][-1] - var.sum().item() / max_b / norms[k]
            direct = directional[k].result() if max_b >= 2 else None
            c = Curve(spec, layer, bs, errors[k], loglog_slope(bs, errors[k]), z2, bias2, direct, seconds)
            curves.append(c)
            log(f"{scheme_label(spec)}, {layer}: err(1) {c.errors[0]:.4g}, err({max_b}) {c.errors[-1]:.3g}, "
                f"slope {c.slope:+.3f}" + (f", z² {z2:.3g}, bias² {bias2:.2g}" if z2 is not None else "")
                + (f"; along G: {direct.describe()}" if direct else "") + f" ({seconds:.1f} s)")
        del qmodel, loss
    return curves


OPERAND_SHAPE = (256, 1024)
OPERAND_ROTATION = 128
DISTRIBUTIONS = ("gaussian", "heavy", "model")
HEAVY_SIGMA = 1.5
"""The heavy-tailed operands are ``N · exp(1.5 · N')`` elementwise (two independent standard
normals): a Gaussian with log-normal scales, whose kurtosis is ``3 e^(4 · 1.5²)``, about 2.4e4."""


class Rotation:
    """One fresh rotation of a draw, along the last dim in chunks of ``OPERAND_ROTATION``:
    ``hadamard`` (SPEC §2 step 1: random signs, then the normalised Hadamard matrix), ``two``
    (that twice, with independent signs) or ``haar`` (a uniformly random orthogonal matrix, the
    rotation EDEN's unbiasedness is proved for; in FP64). The same rotation serves both operands
    of a GEMM, in which it cancels."""

    def __init__(self, kind: str, g: torch.Generator) -> None:
        self.kind = kind
        if kind == "haar":  # QR of a Gaussian matrix, signs fixed so that Q is Haar-distributed
            q, r = torch.linalg.qr(torch.randn(OPERAND_ROTATION, OPERAND_ROTATION, generator=g,
                                               dtype=torch.float64))
            self.q = q * torch.sign(torch.diagonal(r))
        else:
            self.signs = [random_signs(OPERAND_ROTATION, g, "cpu") for _ in range(2 if kind == "two" else 1)]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "haar":
            return (t.double().reshape(*t.shape[:-1], -1, OPERAND_ROTATION) @ self.q).reshape(t.shape).float()
        for s in self.signs:
            t = rotate(t, s)
        return t

    def undo(self, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "haar":
            return (t.double().reshape(*t.shape[:-1], -1, OPERAND_ROTATION) @ self.q.T).reshape(t.shape)
        for s in reversed(self.signs):
            t = unrotate(t, s)
        return t.double()


Quantize = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _eden(posthoc: bool, correction: str) -> Quantize:
    """MS-EDEN steps 2–6 (post hoc or with the tensor amax) of a rotated tensor, its scale draws
    from ``g``; the dequantized estimate, in the rotated basis."""
    def quantize(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        u = torch.rand((*t.shape[:-1], t.shape[-1] // 16), generator=g)
        return quantize_ms_eden(t, u, chunk=OPERAND_ROTATION, posthoc=posthoc, correction=correction).dequantize()
    return quantize


def _sr(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return quantize_sr(t, torch.rand(t.shape, generator=g)).dequantize()


def operand_estimators(x: torch.Tensor, seed: int, y: torch.Tensor | None = None
                       ) -> dict[str, tuple[torch.Tensor, Callable[[int], torch.Tensor]]]:
    """The estimators of the direct test, each as (the tensor it estimates, a function of the
    draw index returning one estimate). Draw ``i`` takes its uniforms and its rotation from a
    generator seeded ``(seed, i)``.

    One fixed rotation (its signs from ``seed``), against the rotated tensor: ``ms_eden`` and
    ``ms_eden (post hoc)`` (steps 2–6), ``ms_eden energy`` and its post hoc form (the
    energy-weighted correction, :func:`~quant.quantizers.quantize_ms_eden`'s ``correction``).
    Along the rotated tensor these are the estimators as a kernel sees them; across its other
    directions a fixed rotation's RTN error is deterministic, so only a fresh rotation can
    make it average out.

    Fresh rotation each draw, rotated back and against ``x``: ``rtn, fresh rotation`` (SPEC
    §5's example of a bias a slope misses), ``sr, fresh rotation`` (tetrajet_v2's operands),
    ``ms_eden[ energy][ (post hoc)], fresh rotation`` (quartet2's operands as training draws
    them), and, with the energy correction post hoc, ``two fresh rotations`` and ``a fresh
    Haar rotation`` (:class:`Rotation`). Without rotation: ``sr`` (SPEC §2, 1×16 SR) and
    ``sr+4/6`` (4/6 selection on SR: the biased control).

    GEMM level, against the exact ``X Yᵀ`` (``y``: a second Gaussian of ``x``'s shape from
    ``seed + 1`` unless given; the GEMM reduces over the last dim): ``gemm ms_eden (post hoc)``
    and ``gemm ms_eden energy (post hoc)``, quartet2's backward GEMM as training runs it (both
    operands rotated by the same fresh signs, then post hoc MS-EDEN); ``gemm ms_eden energy
    (post hoc), two rotations`` and ``…, Haar rotation`` with those rotations; ``gemm sr``
    (both operands SR after the same fresh rotation: tetrajet_v2's GEMMs)."""
    fixed = random_signs(OPERAND_ROTATION, torch.Generator().manual_seed(seed), "cpu")
    x_rot = rotate(x, fixed)
    if y is None:
        y = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    xy = x.double() @ y.double().T

    def gen(i: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 1_000_003 + i)

    def fixed_rotation(quantize: Quantize):
        return lambda i: quantize(x_rot, gen(i))

    def fresh(quantize: Quantize, kind: str = "hadamard"):
        def draw(i: int) -> torch.Tensor:
            g = gen(i)
            r = Rotation(kind, g)
            return r.undo(quantize(r.apply(x), g))
        return draw

    def gemm(quantize: Quantize, kind: str = "hadamard"):
        def draw(i: int) -> torch.Tensor:
            g = gen(i)
            r = Rotation(kind, g)
            xq, yq = (quantize(r.apply(t), g).double() for t in (x, y))
            return xq @ yq.T
        return draw

    energy = _eden(True, "energy")
    return {
        "sr": (x, lambda i: _sr(x, gen(i))),
        "sr+4/6": (x, lambda i: quantize_sr(x, torch.rand(x.shape, generator=gen(i)),
                                            four_over_six=True).dequantize()),
        "ms_eden": (x_rot, fixed_rotation(_eden(False, "chunk_scaled"))),
        "ms_eden (post hoc)": (x_rot, fixed_rotation(_eden(True, "chunk_scaled"))),
        "ms_eden energy": (x_rot, fixed_rotation(_eden(False, "energy"))),
        "ms_eden energy (post hoc)": (x_rot, fixed_rotation(energy)),
        "rtn, fresh rotation": (x, fresh(lambda t, g: quantize_rtn(t).dequantize())),
        "sr, fresh rotation": (x, fresh(_sr)),
        "ms_eden, fresh rotation": (x, fresh(_eden(False, "chunk_scaled"))),
        "ms_eden (post hoc), fresh rotation": (x, fresh(_eden(True, "chunk_scaled"))),
        "ms_eden energy, fresh rotation": (x, fresh(_eden(False, "energy"))),
        "ms_eden energy (post hoc), fresh rotation": (x, fresh(energy)),
        "ms_eden energy (post hoc), two fresh rotations": (x, fresh(energy, "two")),
        "ms_eden energy (post hoc), fresh Haar rotation": (x, fresh(energy, "haar")),
        "gemm ms_eden (post hoc)": (xy, gemm(_eden(True, "chunk_scaled"))),
        "gemm ms_eden energy (post hoc)": (xy, gemm(energy)),
        "gemm ms_eden energy (post hoc), two rotations": (xy, gemm(energy, "two")),
        "gemm ms_eden energy (post hoc), Haar rotation": (xy, gemm(energy, "haar")),
        "gemm sr": (xy, gemm(_sr)),
    }


def synthetic_operands(distribution: str, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """X (from ``seed``) and Y (from ``seed + 1``), both of ``shape``: standard Gaussians, or
    heavy-tailed ones (:data:`HEAVY_SIGMA`)."""
    def one(s: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(s)
        t = torch.randn(shape, generator=g)
        return t * torch.exp(HEAVY_SIGMA * torch.randn(shape, generator=g)) if distribution == "heavy" else t
    if distribution not in ("gaussian", "heavy"):
        raise StudyError(f"unknown synthetic distribution {distribution!r}; choose gaussian or heavy")
    return one(seed), one(seed + 1)


def model_operands(model: Llama, x: torch.Tensor, y: torch.Tensor, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A block linear's wgrad operands on a fixed batch, exact (FP32, no quantization): ``Xᵀ``
    (in-features × tokens, the layer's input) and ``Eᵀ`` (out-features × tokens, the gradient
    of the loss with respect to its output), grouped and rotated along tokens as quartet2's
    wgrad does; their product ``Xᵀ E`` is the layer's weight gradient, transposed."""
    resolve_layers(model, [layer])
    tokens = x.numel()
    if tokens % OPERAND_ROTATION:
        raise StudyError(f"{tokens} tokens in the batch; the rotation along tokens needs a multiple of "
                         f"{OPERAND_ROTATION} (choose --batch and --seq-len accordingly)")
    module = model.get_submodule(layer)
    seen: dict[str, torch.Tensor] = {}

    def hook(_mod, inputs, output):
        seen["x"] = inputs[0].detach()
        output.register_hook(lambda grad: seen.__setitem__("e", grad.detach()))

    handle = module.register_forward_hook(hook)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        module.weight.requires_grad_(True)
        _loss(model, x, y).backward()
    finally:
        handle.remove()
    return (seen["x"].reshape(tokens, -1).T.contiguous().float(),
            seen["e"].reshape(tokens, -1).T.contiguous().float())


def operand_study(draws: int, seed: int = 0, names: list[str] | None = None,
                  shape: tuple[int, int] = OPERAND_SHAPE, distribution: str = "gaussian",
                  operands: tuple[torch.Tensor, torch.Tensor] | None = None, y_equals_x: bool = False,
                  directions: int = DIRECTIONS) -> dict[str, EstimatorBias]:
    """Both bias statistics (analysis.bias: along the target, and Hotelling's T² over
    ``directions`` random directions from ``seed``) of each estimator of
    :func:`operand_estimators`, over ``draws`` draws, on fixed operands: ``operands`` when
    given (e.g. :func:`model_operands`), else :func:`synthetic_operands` of ``distribution``
    and ``shape`` (SPEC §5's 256×1024 by default). ``y_equals_x``: the GEMM estimators take
    ``Y = X``."""
    x, y = operands if operands is not None else synthetic_operands(distribution, shape, seed)
    estimators = operand_estimators(x, seed, x if y_equals_x else y)
    if unknown := sorted(set(names or []) - set(estimators)):
        raise StudyError(f"unknown operand estimator(s) {unknown}; choose from {sorted(estimators)}")
    return {name: estimator_bias(draw, exact, draws, directions, seed)
            for name, (exact, draw) in estimators.items() if names is None or name in names}


def operand_markdown(stats: dict[str, EstimatorBias], seed: int, what: str) -> str:
    k = next((st.directions.k for st in stats.values() if st.directions is not None), DIRECTIONS)
    rows = [f"## Direct bias test of the quantizers: {what} (seed {seed}), rotation {OPERAND_ROTATION}", "",
            f"| estimator | draws | z along the target | shrinkage ± se | T² over {k} random directions (p) "
            "| bias² | MSE | verdict |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, st in stats.items():
        a, d = st.along, st.directions
        spread = "—" if d is None else f"{d.t2:.1f} ({d.p_value:.1e})"
        size = "— | —" if d is None else f"{d.bias2:+.1e} | {d.mse:.2e}"
        rows.append(f"| {name} | {a.n} | {a.z:+.1f} | {a.shrinkage:+.2e} ± {a.se:.1e} | {spread} | {size} | "
                    + ("**biased**" if st.biased else "no bias seen") + " |")
    rows += ["", "The target is the tensor X for an operand estimator and the exact product X Yᵀ for a GEMM "
             "estimator (gemm ...). "
             f"z = mean of p = ⟨X̂ − X, X⟩/‖X‖² over the draws (X the target), divided by its standard error: N(0, 1) "
             f"for an unbiased estimator; biased when |z| > {Z_FLAG:g}. T²: Hotelling's statistic of the "
             "projections of X̂ − X on fixed random directions, with its p-value under no bias; biased when "
             f"p < {P_FLAG:.1e} (the rate of |z| > {Z_FLAG:g}). analysis.bias derives both. "
             "Shrinkage = −mean p: E[X̂] = (1 − shrinkage)·X along X. bias² estimates ‖E[X̂] − X‖²/‖X‖² (noise "
             "removed, so about 0 ± its noise when unbiased), MSE is one draw's ‖X̂ − X‖²/‖X‖².", ""]
    return "\n".join(rows)


def markdown(curves: list[Curve], header: str = "") -> str:
    out = [header, ""] if header else []
    for layer in dict.fromkeys(c.layer for c in curves):
        cs = [c for c in curves if c.layer == layer]
        out += [f"### {layer}: ‖mean of B backward passes − exact‖² / ‖exact‖² (weight gradient)", "",
                "| B | " + " | ".join(scheme_label(c.scheme) for c in cs) + " |",
                "|---:|" + "---:|" * len(cs)]
        for i, b in enumerate(cs[0].bs):
            out.append(f"| {b} | " + " | ".join(f"{c.errors[i]:.3e}" for c in cs) + " |")
        out.append("| **log-log slope** | " + " | ".join(f"**{c.slope:+.3f}**" for c in cs) + " |")
        b = cs[0].bs[-1]
        out.append(f"| z² at B={b} | " + " | ".join("—" if c.z2 is None else f"{c.z2:.3g}" for c in cs) + " |")
        out.append("| bias² estimate | " + " | ".join("—" if c.bias2 is None else f"{c.bias2:.1e}" for c in cs)
                   + " |")
        out.append(f"| **z along G** (all {b} draws) | "
                   + " | ".join("—" if c.bias is None else f"**{c.bias.z:+.1f}**" + (" ⚠" if c.bias.biased else "")
                                for c in cs) + " |")
        out.append("| shrinkage along G ± se | " + " | ".join(
            "—" if c.bias is None else f"{c.bias.shrinkage:+.1e} ± {c.bias.se:.0e}" for c in cs) + " |")
        out.append("")
    out += ["Slope −1: the error of the mean falls as 1/B (unbiased); a flatter slope, an error that stops "
            "falling, is a bias floor. z² (mean over the gradient's elements of B·(mean − exact)²/variance "
            "at the largest B) is ≈ 1 for an unbiased estimator and grows in proportion to B with a bias. "
            "bias² estimate: err(B) minus the variance share tr(Σ)/(B·‖G‖²), i.e. the floor err(B) "
            "would reach for B → ∞ (≈ 0 when unbiased, noisy at the level of err(B)/√B). "
            "z along G: the mean over the draws of p = ⟨Ĝ − G, G⟩/‖G‖² divided by its standard error, "
            f"N(0, 1) when unbiased; ⚠ marks |z| > {Z_FLAG:g} (analysis.bias gives the threshold's "
            "derivation); shrinkage = −mean p, the relative shrinkage of E[Ĝ] along G.", ""]
    return "\n".join(out)


def plot(curves: list[Curve], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(c.layer for c in curves))
    fig, axes = plt.subplots(1, len(layers), figsize=(5.2 * len(layers), 4.2), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        cs = [c for c in curves if c.layer == layer]
        for c in cs:
            flagged = c.bias is not None and c.bias.biased
            ax.plot(c.bs, c.errors, marker="x" if flagged else "o", ms=5 if flagged else 4,
                    ls="--" if c.scheme.endswith(CONTROL_SUFFIX) else "-",
                    label=f"{scheme_label(c.scheme)} (slope {c.slope:+.2f}"
                          + (f"; biased, z {c.bias.z:+.0f})" if flagged else ")"))
        bs = cs[0].bs
        anchor = math.exp(sum(math.log(c.errors[0]) for c in cs) / len(cs))
        ax.plot(bs, [anchor / b for b in bs], color="black", lw=1, ls=":", label="∝ 1/B")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("B (backward passes averaged)")
        ax.set_ylabel("‖mean Ĝ − G‖² / ‖G‖²")
        ax.set_title(f"{layer} weight gradient (x: |z| > {Z_FLAG:g} along G)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset of configs/model/ or an exported checkpoint .pt")
    p.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES, metavar="SCHEME",
                   help=f"scheme names, NAME{CONTROL_SUFFIX} for the biased control (default: %(default)s)")
    p.add_argument("--layers", nargs="+", default=DEFAULT_LAYERS, metavar="NAME",
                   help="block linears whose weight gradient is studied (default: %(default)s)")
    p.add_argument("--max-b", type=int, default=1024, help="largest number of draws averaged (default 1024)")
    p.add_argument("--ratio", type=int, default=4, help="B = 1, r, r², … up to --max-b (default 4)")
    p.add_argument("--batch", type=int, default=4, help="sequences in the fixed batch (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--data", type=Path, help="prepared dataset dir: use its first validation batch")
    p.add_argument("--seed", type=int, default=0, help="model init, batch and quantizer seed")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: the emulated quantizers run many small ops, which "
                        "extra threads slow down on small models; raise it for large ones)")
    p.add_argument("--out-dir", type=Path, default=Path("unbiasedness"), help="where the md/png/json go")
    p.add_argument("--operands", type=int, metavar="DRAWS",
                   help="instead of the layer study: the direct bias test of the operand quantizers and of "
                        "quartet2's GEMM on fixed operands (--distribution), with DRAWS draws each "
                        "(OUT_DIR/operand_bias.md and .json)")
    p.add_argument("--estimators", nargs="+", metavar="NAME",
                   help="with --operands: only these estimators (default: all; an unknown name lists them)")
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="gaussian",
                   help="with --operands: 256×1024 Gaussian operands (default), heavy-tailed ones "
                        "(N·exp(1.5·N')), or 'model': the wgrad operands Xᵀ, Eᵀ of the first --layers "
                        "layer of --model on the fixed batch (--batch × --seq-len tokens, a multiple of 128)")
    p.add_argument("--y-equals-x", action="store_true",
                   help="with --operands: the GEMM estimators multiply X by itself (Y = X)")
    p.add_argument("--directions", type=int, default=DIRECTIONS,
                   help=f"with --operands: random directions of the T² test (even; default {DIRECTIONS}; 0: none)")
    a = p.parse_args(argv)
    if a.operands is not None:
        return _operands_main(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        torch.manual_seed(a.seed)
        model, cfg, what = load_model(a.model, a.seed, a.device)
        x, y = fixed_batch(cfg, a.batch, a.seq_len, a.seed, a.data)
        curves = study(model, x, y, a.schemes, a.layers, a.max_b, a.ratio, a.seed,
                       log=lambda m: print(m, file=sys.stderr))
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    header = (f"## Backward-pass unbiasedness: {what}, batch {a.batch}×{a.seq_len} tokens, "
              f"backward-only quantization, FP32")
    text = markdown(curves, header)
    print(text)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "unbiasedness.md").write_text(text + "\n")
    (a.out_dir / "unbiasedness.json").write_text(json.dumps({
        "model": what, "batch": a.batch, "seq_len": a.seq_len, "seed": a.seed,
        "curves": [{"scheme": c.scheme, "label": scheme_label(c.scheme), "layer": c.layer, "B": c.bs,
                    "rel_sq_error": c.errors, "slope": c.slope, "z2_at_max_b": c.z2, "bias2_estimate": c.bias2,
                    "direct": None if c.bias is None else vars(c.bias) | {"biased": c.bias.biased},
                    "seconds": c.seconds}
                   for c in curves]}, indent=2) + "\n")
    print(f"plot: {plot(curves, a.out_dir / 'unbiasedness.png')}")
    return 0


def _operands_main(a: argparse.Namespace) -> int:
    if a.operands < 2:
        print(f"error: --operands needs at least 2 draws, got {a.operands}", file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        operands = None
        what = f"fixed {OPERAND_SHAPE[0]}×{OPERAND_SHAPE[1]} {a.distribution} operands"
        if a.distribution == "model":
            torch.manual_seed(a.seed)
            model, cfg, source = load_model(a.model, a.seed, "cpu")
            x, y = fixed_batch(cfg, a.batch, a.seq_len, a.seed, a.data)
            operands = model_operands(model, x, y, a.layers[0])
            what = (f"{a.layers[0]}'s wgrad operands Xᵀ {tuple(operands[0].shape)} and Eᵀ "
                    f"{tuple(operands[1].shape)} of {source}, batch {a.batch}×{a.seq_len}")
        if a.y_equals_x:
            what += ", GEMMs with Y = X"
        stats = operand_study(a.operands, a.seed, a.estimators, distribution=a.distribution,
                              operands=operands, y_equals_x=a.y_equals_x, directions=a.directions)
    except (StudyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    text = operand_markdown(stats, a.seed, what)
    print(text)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "operand_bias.md").write_text(text + "\n")
    (a.out_dir / "operand_bias.json").write_text(json.dumps(
        {"operands": what, "distribution": a.distribution, "rotation": OPERAND_ROTATION, "seed": a.seed,
         "y_equals_x": a.y_equals_x,
         "estimators": {n: {"along": vars(st.along) | {"biased": st.along.biased},
                            "directions": None if st.directions is None
                            else vars(st.directions) | {"biased": st.directions.biased},
                            "biased": st.biased}
                        for n, st in stats.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
