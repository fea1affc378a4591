"""Training schemes as data (SPEC §3).

A linear layer ``Y = X Wᵀ`` runs three GEMMs, each written ``A · Bᵀ`` with both operands
quantized along their shared last (reduction) dimension:

=========  =============  ==========  ==========================
GEMM       A              B           reduction
=========  =============  ==========  ==========================
forward    X   (T×K)      W  (N×K)    in-features K
dgrad      E   (T×N)      Wᵀ (K×N)    out-features N
wgrad      Eᵀ  (N×T)      Xᵀ (K×T)    tokens T
=========  =============  ==========  ==========================

A :class:`Scheme` says, per operand, which quantizer it gets (``none``, ``rtn``, ``rtn_2d``,
``sr``, ``ms_eden``), whether 4/6 selection is on, and, for the backward operands X and W, whether
they come from the high-precision tensor (``source="input"``) or from the forward's quantized
tensor (``source="quantized"``, which is then what the layer saves for backward). An optional
randomized Hadamard rotation of size ``h`` acts on both operands of a GEMM. One autograd
Function (:mod:`quant.linear`) executes any scheme, so a new scheme is a new entry here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .hadamard import check_rotation_size
from .quantizers import EDEN_CORRECTIONS

QUANTIZERS = ("none", "rtn", "rtn_2d", "sr", "ms_eden")
STOCHASTIC = ("sr", "ms_eden")


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized.

    Attributes:
        quantizer: one of :data:`QUANTIZERS`.
        four_over_six: 4/6 block-scale selection (SPEC §2). On ``sr`` it is the biased ablation.
        source: for the backward operands X and W: ``"input"`` (the high-precision tensor) or
            ``"quantized"`` (the forward's quantized tensor). Ignored for E and forward operands.
        posthoc: MS-EDEN only: post hoc range alignment instead of a tensor amax pass (SPEC §2;
            ``quant.quantizers.quantize_ms_eden``), which lets the kernels quantize in one pass.
        eden_correction: MS-EDEN only: step 4's S, ``"chunk_scaled"`` (SPEC §2 as written) or
            ``"energy"`` (over the unscaled values; ``docs/spec.md`` §5).
    """

    quantizer: str = "none"
    four_over_six: bool = False
    source: str = "input"
    posthoc: bool = False
    eden_correction: str = "chunk_scaled"

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"unknown quantizer {self.quantizer!r}; choose one of {QUANTIZERS}")
        if self.source not in ("input", "quantized"):
            raise ValueError(f"operand source must be 'input' or 'quantized', got {self.source!r}")
        if self.four_over_six and self.quantizer not in ("rtn", "rtn_2d", "sr"):
            raise ValueError(f"4/6 selection applies to rtn, rtn_2d or sr, not {self.quantizer!r}")
        if self.posthoc and self.quantizer != "ms_eden":
            raise ValueError(f"post hoc range alignment applies to ms_eden, not {self.quantizer!r}")
        if self.eden_correction not in EDEN_CORRECTIONS:
            raise ValueError(f"unknown eden_correction {self.eden_correction!r}; choose one of {EDEN_CORRECTIONS}")
        if self.eden_correction != "chunk_scaled" and self.quantizer != "ms_eden":
            raise ValueError(f"eden_correction applies to ms_eden, not {self.quantizer!r}")


@dataclass(frozen=True)
class Gemm:
    """Quantization of one GEMM ``A · Bᵀ``: the two operands and an optional rotation size."""

    a: Operand = field(default_factory=Operand)
    b: Operand = field(default_factory=Operand)
    rotation: int | None = None

    def __post_init__(self) -> None:
        if self.rotation is not None:
            check_rotation_size(self.rotation)
        if "ms_eden" in (self.a.quantizer, self.b.quantizer) and self.rotation is None:
            raise ValueError("MS-EDEN needs a rotation: its correction works per rotation chunk")

    @property
    def quantized(self) -> bool:
        return self.a.quantizer != "none" or self.b.quantizer != "none"

    @property
    def stochastic(self) -> bool:
        return self.rotation is not None or any(
            o.quantizer in STOCHASTIC for o in (self.a, self.b)
        )


@dataclass(frozen=True)
class Scheme:
    """A training scheme: the forward, dgrad and wgrad GEMMs of SPEC §3 (see module docstring).

    ``delayed_amax`` reuses each operand's previous amax for its tensor scale (SPEC §3 ablation).
    ``skip`` holds the default module-name patterns that stay in high precision.
    """

    name: str
    forward: Gemm = field(default_factory=Gemm)
    dgrad: Gemm = field(default_factory=Gemm)
    wgrad: Gemm = field(default_factory=Gemm)
    delayed_amax: bool = False
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.forward.rotation is not None:
            raise ValueError("forward rotation is not supported: SPEC §3 rotates backward GEMMs only")
        if "ms_eden" in (self.forward.a.quantizer, self.forward.b.quantizer):
            raise ValueError("MS-EDEN is a backward quantizer (SPEC §3)")
        for o in (self.forward.a, self.dgrad.a, self.dgrad.b, self.wgrad.a, self.wgrad.b):
            if o.quantizer == "rtn_2d":
                raise ValueError("16×16 quantization applies to the forward weight only (SPEC §3)")

    @property
    def is_identity(self) -> bool:
        """True when no GEMM quantizes or rotates anything (the scheme equals ``F.linear``)."""
        return not any(g.quantized or g.rotation for g in (self.forward, self.dgrad, self.wgrad))

    @property
    def saves_quantized_x(self) -> bool:
        return self.wgrad.b.source == "quantized" and self.forward.a.quantizer != "none"

    @property
    def saves_quantized_w(self) -> bool:
        return self.dgrad.b.source == "quantized" and self.forward.b.quantizer != "none"


def _q(quantizer: str, four_over_six: bool = False, source: str = "input") -> Operand:
    return Operand(quantizer, four_over_six, source, posthoc=quantizer == "ms_eden")


# SPEC §3, one entry per row of the scheme table.
_NVIDIA = Scheme(
    name="nvidia",
    forward=Gemm(_q("rtn"), _q("rtn_2d")),
    dgrad=Gemm(_q("sr"), _q("none", source="quantized")),
    wgrad=Gemm(_q("sr"), _q("rtn", source="input"), rotation=16),
)

SCHEMES: dict[str, Scheme] = {
    "bf16": Scheme(name="bf16"),
    "nvidia": _NVIDIA,
    "four_over_six": replace(
        _NVIDIA,
        name="four_over_six",
        forward=Gemm(_q("rtn", True), _q("rtn_2d", True)),
    ),
    "tetrajet_v2": Scheme(
        name="tetrajet_v2",
        forward=Gemm(_q("rtn"), _q("rtn")),
        dgrad=Gemm(_q("sr"), _q("sr", source="quantized"), rotation=32),
        wgrad=Gemm(_q("sr"), _q("sr", source="quantized"), rotation=32),
    ),
    "quartet2": Scheme(
        name="quartet2",
        forward=Gemm(_q("rtn", True), _q("rtn", True)),
        dgrad=Gemm(_q("ms_eden"), _q("ms_eden", source="quantized"), rotation=128),
        wgrad=Gemm(_q("ms_eden"), _q("ms_eden", source="quantized"), rotation=128),
    ),
}


def _with_operands(g: Gemm, quantizers: tuple[str, ...], **changes) -> Gemm:
    """``g`` with ``changes`` applied to those of its operands whose quantizer is in ``quantizers``."""
    def op(o: Operand) -> Operand:
        return replace(o, **changes) if o.quantizer in quantizers else o

    return replace(g, a=op(g.a), b=op(g.b))


def _without_quantization(g: Gemm) -> Gemm:
    return Gemm(replace(g.a, quantizer="none", four_over_six=False, posthoc=False),
                replace(g.b, quantizer="none", four_over_six=False, posthoc=False))


def bf16_gemms(scheme: Scheme, *, forward: bool = False, backward: bool = False) -> Scheme:
    """``scheme`` with its forward GEMM (``forward``) and/or its dgrad and wgrad (``backward``)
    unquantized and unrotated: what :func:`get_scheme`'s ``forward=False`` / ``backward=False``
    do, applied to any scheme (the precisions of :mod:`quant.recipe`).

    With the forward unquantized, a backward operand of ``source="quantized"`` reads the
    forward's operand, which is then the high-precision X or W itself: nvidia's dgrad multiplies
    E (SR) by W in the compute dtype (BF16 under autocast); quartet2's and tetrajet_v2's dgrad
    and wgrad rotate and quantize the high-precision W and X as their quantizers say. So the
    backward stays the scheme's, on the operands the forward used, and no Ŵ is saved or
    quantized once per step (:attr:`Scheme.saves_quantized_w`,
    :func:`quant.step_weights.caches_forward_weight`)."""
    fwd = _without_quantization(scheme.forward) if forward else scheme.forward
    dgrad, wgrad = ((_without_quantization(scheme.dgrad), _without_quantization(scheme.wgrad)) if backward
                    else (scheme.dgrad, scheme.wgrad))
    return replace(scheme, forward=fwd, dgrad=dgrad, wgrad=wgrad)


RANGE_ALIGNMENTS = ("posthoc", "amax")


def get_scheme(
    name: str,
    *,
    forward: bool = True,
    backward: bool = True,
    rotation: int | None = None,
    four_over_six: bool | None = None,
    sr_four_over_six: bool = False,
    delayed_amax: bool = False,
    range_alignment: str | None = None,
    eden_correction: str = "chunk_scaled",
) -> Scheme:
    """A named scheme with the ablation switches of SPEC §3 applied.

    Args:
        name: one of :data:`SCHEMES`.
        forward: ``False`` turns forward quantization off (X and W stay high precision).
        backward: ``False`` turns backward quantization off: dgrad and wgrad are exact GEMMs on
            what the layer saved, i.e. the exact gradient of the (quantized) forward.
        rotation: overrides the Hadamard size of every backward GEMM that rotates.
        four_over_six: turns 4/6 selection on or off for the forward RTN operands.
        sr_four_over_six: applies 4/6 to SR operands: a **biased** estimator, offered only as
            the negative control of the unbiasedness tests (SPEC §3, known pitfall).
        delayed_amax: tensor scales from the previous call's amax.
        range_alignment: how MS-EDEN operands get their tensor scale: ``"posthoc"`` (the
            presets' default: post hoc range alignment, SPEC §2, one quantization pass) or
            ``"amax"`` (SPEC §2's table: a tensor amax first). ``None``: ``"amax"`` with
            ``delayed_amax`` (post hoc alignment has no amax to delay), else ``"posthoc"``.
        eden_correction: MS-EDEN step 4's S: ``"chunk_scaled"`` (SPEC §2, the default) or
            ``"energy"`` (groups weighted by their block scale squared; ``docs/spec.md`` §5), on
            every backend.
    """
    if name not in SCHEMES:
        raise ValueError(
            f"unknown quantization scheme {name!r}; choose one of {sorted(SCHEMES)} "
            f"(e.g. quant=quartet2)."
        )
    s = SCHEMES[name]
    fwd, dgrad, wgrad = s.forward, s.dgrad, s.wgrad
    if rotation is not None:
        check_rotation_size(rotation)
        dgrad = replace(dgrad, rotation=rotation) if dgrad.rotation else dgrad
        wgrad = replace(wgrad, rotation=rotation) if wgrad.rotation else wgrad
    if four_over_six is not None:
        fwd = _with_operands(fwd, ("rtn", "rtn_2d"), four_over_six=four_over_six)
    if sr_four_over_six:
        dgrad, wgrad = (_with_operands(g, ("sr",), four_over_six=True) for g in (dgrad, wgrad))
    if range_alignment is None:
        range_alignment = "amax" if delayed_amax else "posthoc"
    if range_alignment not in RANGE_ALIGNMENTS:
        raise ValueError(f"unknown range_alignment {range_alignment!r}; choose one of {RANGE_ALIGNMENTS}")
    if delayed_amax and range_alignment == "posthoc":
        raise ValueError("delayed_amax needs range_alignment='amax': post hoc range alignment "
                         "computes no tensor amax to delay")
    if eden_correction not in EDEN_CORRECTIONS:
        raise ValueError(f"unknown eden_correction {eden_correction!r}; choose one of {EDEN_CORRECTIONS}")
    dgrad, wgrad = (_with_operands(g, ("ms_eden",), posthoc=range_alignment == "posthoc",
                                   eden_correction=eden_correction) for g in (dgrad, wgrad))
    if not forward:
        fwd = _without_quantization(fwd)
    if not backward:
        dgrad, wgrad = _without_quantization(dgrad), _without_quantization(wgrad)
    return replace(s, forward=fwd, dgrad=dgrad, wgrad=wgrad, delayed_amax=delayed_amax)


ABLATIONS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(get_scheme).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}
"""The ablation switches of :func:`get_scheme` (SPEC §3) and their defaults, which leave a named
scheme as :data:`SCHEMES` defines it."""

LAYER_KEYS = ("skip", "keep_edge_blocks", "bf16_tail", "recipe", "schedule")
"""Keys of a quant config (configs/quant/) that choose which layers and GEMMs get the scheme, and
when, not the scheme: read by :func:`quant.recipe.recipe_from_config` (the first four) and
:mod:`training.precision_schedule` (``schedule``)."""


def scheme_from_config(cfg: Mapping[str, Any]) -> Scheme:
    """The scheme a quant config (e.g. ``cfg.quant`` of configs/train.yaml) describes.

    ``cfg["name"]`` names one of :data:`SCHEMES`; every other key is an ablation switch of
    :func:`get_scheme` (see :data:`ABLATIONS`; a missing one keeps its default) or one of
    :data:`LAYER_KEYS`, which this ignores. Any other key is refused with a ValueError naming it
    and the accepted keys.
    """
    accepted = ("name", *ABLATIONS, *LAYER_KEYS)
    unknown = [k for k in cfg if k not in accepted]
    if unknown:
        raise ValueError(f"unknown quant config key(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(accepted)}")
    if "name" not in cfg:
        raise ValueError(f"a quant config needs a scheme name: name: one of {list(SCHEMES)}")
    return get_scheme(cfg["name"], **{k: cfg[k] for k in ABLATIONS if k in cfg})
