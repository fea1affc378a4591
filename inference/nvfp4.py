"""A trained model's forward weights Ŵ in compressed-tensors' ``nvfp4-pack-quantized`` format
(docs/export.md), the NVFP4 checkpoint format that vLLM and transformers load.

Per quantized linear ``m`` the format stores (compressed-tensors 0.20, ``NVFP4PackedCompressor``):

* ``m.weight_packed``: uint8, two E2M1 codes per byte, element ``2i`` in the low nibble (SPEC §1;
  :func:`quant.format.pack_codes` writes this very order and code table);
* ``m.weight_scale``: float8_e4m3fn, one per 1×16 group along in-features;
* ``m.weight_global_scale``: FP32 ``[1]``, the *reciprocal* of the tensor scale: compressed-tensors
  dequantizes ``Ŵ = q · (s_b / g)`` (``_dequantize`` in ``quantization/lifecycle/forward_helpers.py``,
  the codes and scales widened to BF16, the quotient and product in FP32, the result rounded to BF16);
* ``m.input_global_scale``: FP32 ``[1]``, ``448 · 6 / amax(X)`` over calibration data (its
  ``generate_gparam``), the static tensor scale of the activations, whose 1×16 block scales are
  computed at run time.

What is carried over exactly (SPEC §3, the forward column; every forward weight quantizer is
deterministic, unrotated RTN, so Ŵ is a function of the weight alone): the E2M1 codes and the E4M3
block scales, bit for bit; a 16×16 tile's scale (``nvidia``, ``four_over_six``) is written to each
of the tile's 16 row groups, which is the same Ŵ. The FP32 tensor scale ``s_t`` cannot be: the
format holds ``1 / s_t``, and ``s_b / g`` rounds. :func:`weight_global_scale` therefore picks the
FP32 ``g`` nearest ``1 / s_t`` for which compressed-tensors' dequantization, in its own arithmetic,
gives every element of the tensor's Ŵ rounded to BF16 (SPEC §1's ``(q · s_b) · s_t`` in FP32,
then rounded once more), bit for bit; it checks every element, and raises when no ``g`` within
:data:`GLOBAL_SCALE_SEARCH` FP32 steps of ``1 / s_t`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from model.hf import hf_linears
from model.llama import LlamaConfig
from quant.format import E2M1_MAX, E4M3_MAX, GROUP, NVFP4Tensor, decode_e2m1, encode_e2m1, pack_codes, unpack_codes
from quant.linear import quantize_forward_weight
from quant.quantizers import quantize_rtn
from quant.recipe import recipe_from_config
from quant.schemes import scheme_from_config

CT_FORMAT = "nvfp4-pack-quantized"
GLOBAL_SCALE_SEARCH = 64
"""How many FP32 steps on either side of ``1 / s_t`` :func:`weight_global_scale` tries."""


def as_1x16(t: NVFP4Tensor) -> NVFP4Tensor:
    """``t`` with one block scale per 1×16 group along its last dim: a 16×16 tile's scale is
    repeated to the tile's 16 rows. The same values: ``as_1x16(t).dequantize()`` equals
    ``t.dequantize()`` bit for bit (SPEC §1, ``x̂ = (q · s_b) · s_t`` per element)."""
    if t.dim not in (-1, t.q.dim() - 1):
        raise ValueError(f"a weight quantized along dim {t.dim} is not grouped along in-features, "
                         f"as the forward GEMM's weight is (SPEC §3)")
    if t.tile == "1x16":
        return t
    return NVFP4Tensor(q=t.q, block_scale=t.block_scale.repeat_interleave(GROUP, 0),
                       tensor_scale=t.tensor_scale, dim=-1, tile="1x16")


def ct_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dequantization of an ``nvfp4-pack-quantized`` weight, in its arithmetic
    (``NVFP4PackedCompressor.decompress``: codes and E4M3 scales widened to BF16, exactly; then
    ``q · (s_b / g)`` with the quotient and the product rounded to FP32, and the result to BF16).
    Used to choose ``g``; the tests check the exported folder with compressed-tensors itself."""
    q = decode_e2m1(unpack_codes(packed)).bfloat16().float()
    scale = scales.to(torch.bfloat16).float() / global_scale.float()
    rows, cols = q.shape
    return (q.reshape(rows, cols // GROUP, GROUP) * scale.unsqueeze(-1)).reshape(rows, cols).bfloat16()


def _fp32_neighbours(x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``x`` (positive FP32, 0-dim) and the FP32 values 1, -1, 2, -2, ... ``steps`` bit patterns
    away, nearest first."""
    bits = x.float().reshape(1).view(torch.int32)
    order = [0] + [k for i in range(1, steps + 1) for k in (i, -i)]
    return [(bits + k).view(torch.float32) for k in order]


def bf16_midpoints(x: torch.Tensor) -> torch.Tensor:
    """Where FP32 ``x`` lies exactly halfway between two BF16 values (its low 16 bits are 0x8000):
    there rounding to BF16 is a tie, which ties-to-even decides."""
    return (x.float().view(torch.int32) & 0xFFFF) == 0x8000


def weight_global_scale(t: NVFP4Tensor, name: str = "weight") -> tuple[torch.Tensor, int]:
    """The FP32 ``weight_global_scale`` (shape ``[1]``) of a 1×16 Ŵ, and how many elements of Ŵ it
    gives as a tie's other BF16 neighbour.

    Of the FP32 values within :data:`GLOBAL_SCALE_SEARCH` steps of ``1 / s_t``, nearest first, the
    first for which :func:`ct_dequantize` gives ``t.dequantize()`` rounded to BF16 in every element,
    bit for bit (module docstring). When Ŵ has elements exactly halfway between two BF16 values (a
    tensor scale of few significant bits, e.g. from a BF16 weight whose amax is a multiple of 21,
    ``s_t = amax / (6 · 448)``), no FP32 ``1 / s_t`` may round every such tie to even, since
    ``s_b / g`` is then never exact: the value with the fewest mismatches is taken, provided every
    mismatch is such a tie given as the other neighbour (as far from Ŵ as the even one); the count
    is returned. ValueError, naming ``name``, when Ŵ is not finite (a diverged run) or no value
    meets this."""
    s_t = t.tensor_scale.float()
    if not bool(torch.isfinite(s_t)):
        raise ValueError(f"{name}: its quantized weight is NaN (the weight holds NaN or inf, SPEC §6.4): "
                         f"the run diverged. Fix: export an earlier checkpoint.")
    exact = t.dequantize()
    target, ties = exact.bfloat16().view(torch.int16), bf16_midpoints(exact)
    packed, scales = pack_codes(encode_e2m1(t.q)), t.block_scale.to(torch.float8_e4m3fn)
    best: tuple[int, torch.Tensor] | None = None
    fewest = None
    for g in _fp32_neighbours(1.0 / s_t, GLOBAL_SCALE_SEARCH):
        if not bool(torch.isfinite(g)) or g.item() <= 0:
            continue
        got = ct_dequantize(packed, scales, g).view(torch.int16)
        wrong = got != target
        mismatches = int(wrong.sum())
        if mismatches == 0:
            return g, 0
        fewest = mismatches if fewest is None else min(fewest, mismatches)
        other_neighbour = ((got.int() - target.int()).abs() == 1) & ties
        if bool((other_neighbour | ~wrong).all()) and (best is None or mismatches < best[0]):
            best = (mismatches, g)
    if best is not None:
        return best[1], best[0]
    raise ValueError(f"{name}: no FP32 global scale within {GLOBAL_SCALE_SEARCH} steps of 1/s_t "
                     f"(s_t = {s_t.item():.9g}) reproduces its Ŵ in BF16 through compressed-tensors' "
                     f"dequantization (fewest mismatches: {fewest}). Report this with the checkpoint.")


def input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``input_global_scale = 448 · 6 / amax`` in FP32, shape ``[1]``: compressed-tensors'
    ``generate_gparam`` (the activations' largest group maps to block scale 448 and element 6).
    ValueError for an amax that is not positive and finite."""
    amax = amax.float().reshape(1)
    if not (bool(torch.isfinite(amax)) and amax.item() > 0):
        raise ValueError(f"calibration gave an activation amax of {amax.item()}: the activations are "
                         f"all zero or not finite. Fix: calibrate on other batches (--calib-batches).")
    return torch.tensor([E4M3_MAX * E2M1_MAX], dtype=torch.float32) / amax


def forward_weight_dtype(config: Mapping[str, Any], world_size: int | None) -> torch.dtype:
    """The dtype of the weight that a run's forward quantized: BF16 when FSDP2 cast the parameters
    (``precision=bf16`` and ``parallel.fsdp`` true, or auto with more than one rank:
    ``model.parallel.apply_fsdp``'s mixed-precision policy), else the FP32 master weight.
    ValueError when the run's config cannot tell (``precision`` unresolved, or ``fsdp=auto`` and
    the world size unknown, as for a consolidated ``.pt``), naming the fix."""
    precision = config.get("precision")
    fsdp = (config.get("parallel") or {}).get("fsdp", "auto")
    fix = "Fix: pass --forward-weights bf16 (trained with FSDP2 in BF16) or fp32 (in one process, or in FP32)."
    if precision == "fp32":
        return torch.float32
    if precision != "bf16":
        raise ValueError(f"the run's config has precision={precision!r}, not the resolved bf16 or fp32. {fix}")
    if fsdp is True or (fsdp == "auto" and world_size is not None and world_size > 1):
        return torch.bfloat16
    if fsdp is False or (fsdp == "auto" and world_size == 1):
        return torch.float32
    raise ValueError(f"the run trained in BF16 with parallel.fsdp={fsdp!r} on an unknown number of ranks "
                     f"(a consolidated .pt does not record it). {fix}")


def forward_weights(state: Mapping[str, torch.Tensor], cfg: LlamaConfig, quant_cfg: Mapping[str, Any],
                    weight_dtype: torch.dtype = torch.float32) -> tuple[dict[str, NVFP4Tensor], list[str], bool]:
    """Ŵ of every linear of a trained model that the export quantizes, in 1×16 groups; the framework
    linears it keeps in BF16; and whether Ŵ is post-training RTN (the run's forward did not quantize
    weights: ``quant=bf16``, or ``quant.forward=false``).

    A run that trained with quantized forward weights gets its forward Ŵ
    (:func:`quant.linear.quantize_forward_weight`, from the weight in ``weight_dtype``: the FP32
    master weight in one process, its BF16 copy when FSDP2 cast the parameters, SPEC §4's BF16
    autocast), and its layers whose forward ran in BF16 (the precision recipe, :mod:`quant.recipe`:
    ``quant.skip``, ``keep_edge_blocks``, ``bf16_tail`` and the ``recipe`` rules of precision
    ``bf16`` or ``bf16_forward``; ``lm_head`` by default) stay BF16. A run whose forward weights
    were BF16 gets RTN 1×16 of its FP32 master weights (SPEC §2, the RTN row) on every layer but
    its ``bf16`` ones: the PTQ comparison point. The late switch (``quant.schedule``) is not
    applied: the export holds the Ŵ of the recipe's NVFP4 forward."""
    scheme = scheme_from_config(quant_cfg)
    ptq = scheme.forward.b.quantizer == "none"
    recipe = recipe_from_config(quant_cfg, cfg.n_layer, scheme.skip)
    bf16 = ("bf16",) if ptq else ("bf16", "bf16_forward")
    weights, kept = {}, []
    for name in hf_linears(cfg):
        if recipe.precision_of(name) in bf16:
            kept.append(name)
            continue
        w = state[f"{name}.weight"]
        q = (quantize_rtn(w.float()) if ptq else
             quantize_forward_weight(w.to(weight_dtype), scheme, state.get(f"{name}.delayed_amax")))
        weights[name] = as_1x16(q)
    return weights, kept, ptq


def quantization_config(ignore: Iterable[str], activations: bool) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json``: one group targeting every ``Linear`` with
    compressed-tensors' NVFP4 preset (``NVFP4``; weights only, its ``NVFP4A16``, without
    ``activations``), the ``nvfp4-pack-quantized`` format, and ``ignore``: the HF modules kept in BF16."""
    def args(dynamic: Any, **extra: Any) -> dict[str, Any]:
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP, "strategy": "tensor_group",
                "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn", **extra}

    group = {"targets": ["Linear"], "weights": args(False),
             "input_activations": args("local", observer="static_minmax") if activations else None,
             "output_activations": None, "format": CT_FORMAT}
    return {"quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": sorted(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}, "version": "0.20.1"}


def compressed_state_dict(cfg: LlamaConfig, weights: Mapping[str, NVFP4Tensor],
                          input_amax: Mapping[str, torch.Tensor] | None,
                          dense: Mapping[str, torch.Tensor]
                          ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int]]:
    """The tensors of ``model.safetensors``, the ``ignore`` list (the embedding and every linear
    kept in BF16, by HF module name) of an NVFP4 export, and the framework linears whose Ŵ has
    BF16 ties given as the other neighbour (:func:`weight_global_scale`), with their counts.

    ``dense`` is the HF state dict of the model (``model.hf.to_hf_state_dict``): every tensor of a
    module that is not quantized is written from it in BF16. Each quantized framework linear (in
    ``weights``) becomes its HF modules (``model.hf.hf_linears``, rows split as there), each with
    ``weight_packed``, ``weight_scale``, the fused tensor's one ``weight_global_scale`` (so that
    q/k/v and up/gate share it, as vLLM's fused layers require) and, with ``input_amax`` (framework
    linear → calibrated amax of its input), ``input_global_scale``."""
    linears = hf_linears(cfg)
    out: dict[str, torch.Tensor] = {}
    quantized_hf = set()
    ties = {}
    for name, t in weights.items():
        g, ties[name] = weight_global_scale(t, name)
        packed, scales = pack_codes(encode_e2m1(t.q)), t.block_scale.to(torch.float8_e4m3fn)
        rows = [r for _, r in linears[name]]
        for (hf, _), p, s in zip(linears[name], packed.split(rows), scales.split(rows)):
            quantized_hf.add(hf)
            out |= {f"{hf}.weight_packed": p.contiguous(), f"{hf}.weight_scale": s.contiguous(),
                    f"{hf}.weight_global_scale": g.clone()}
            if input_amax is not None:
                out[f"{hf}.input_global_scale"] = input_global_scale(input_amax[name])
    for key, v in dense.items():
        if key.removesuffix(".weight") not in quantized_hf:
            out[key] = v.detach().to(torch.bfloat16, copy=True).contiguous()
    ignore = [hf for name, mods in linears.items() if name not in weights for hf, _ in mods]
    return out, ["model.embed_tokens", *ignore], {k: n for k, n in ties.items() if n}
