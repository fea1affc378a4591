"""A trained model as an NVFP4 serving engine runs it, emulated in the framework (docs/export.md):
the calibration of the activations' static tensor scale, and the three ways of serving that
docs/export.md compares.

* ``bf16``: the master weights, unquantized (what ``scripts/export_hf.py --format hf`` exports).
* ``w4a16``: the exported Ŵ (:func:`inference.nvfp4.forward_weights`, SPEC §1's ``(q · s_b) · s_t``
  in FP32) in every quantized linear, activations unquantized.
* ``w4a4``: Ŵ, and each quantized linear's input quantized as vLLM's NVFP4 path does with a static
  ``input_global_scale`` ``g`` (:func:`vllm_activation_qdq`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data.loader import val_batches
from data.prepare import dataset_dir
from model.llama import Llama, build_model
from quant.format import E2M1_MAX, E4M3_MAX, NVFP4Tensor, round_e2m1, to_groups
from quant.recipe import quantize_with_recipe, recipe_from_config
from quant.schemes import scheme_from_config

from .nvfp4 import input_global_scale

MODES = ("bf16", "w4a16", "w4a4")


def trained_model(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Llama:
    """The model as it trained: ``build_model`` with the run's scheme on its quantized layers
    (its precision recipe, :func:`quant.recipe.quantize_with_recipe`), the checkpoint's weights,
    eval mode."""
    model = build_model(config["model"], device="cpu")
    scheme = scheme_from_config(config["quant"])
    quantize_with_recipe(model, scheme, recipe_from_config(config["quant"], model.config.n_layer, scheme.skip))
    model.load_state_dict(state, strict=False)
    return model.eval()


def validation_batches(config: Mapping[str, Any], count: int | None, fix: str,
                       batch_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of a run's validation split (``train.seq_len`` × ``batch_size``, default
    ``train.eval_batch_size``; ``data.loader.val_batches``, the evenly spaced set the run validated
    on). ValueError ending in ``fix`` when the run's prepared dataset is not on this machine or is
    too small."""
    from omegaconf import OmegaConf

    train = config.get("train") or {}
    try:
        data_dir = dataset_dir(OmegaConf.create(config["data"]))
        size = batch_size or train.get("eval_batch_size") or train["batch_size"]
        return list(val_batches(data_dir, train["seq_len"], size, count))
    except (KeyError, ValueError, FileNotFoundError) as err:
        raise ValueError(f"the run's validation data cannot be read ({err}). {fix}") from None


@torch.no_grad()
def calibrate_input_amax(model: nn.Module, names: Iterable[str],
                         batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The largest |x| that each linear of ``names`` receives over ``batches`` (inputs, targets),
    the model running its own forward: a static min-max observer, compressed-tensors' ``static_minmax``
    for ``input_global_scale``. ValueError when ``batches`` is empty."""
    amax = {n: torch.zeros((), dtype=torch.float32) for n in names}

    def observe(name: str):
        def hook(_module, args):
            amax[name] = torch.maximum(amax[name], args[0].detach().abs().amax().float().cpu())
        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(observe(n)) for n in amax]
    try:
        seen = 0
        for x, _ in batches:
            model(x)
            seen += 1
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise ValueError("no calibration batch: the validation split gave none. Fix: --calib-batches 1 or more.")
    return amax


def vllm_activation_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to NVFP4 and dequantized as vLLM's NVFP4 emulation does (``ref_nvfp4_quant``
    and ``run_nvfp4_emulations``, ``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``),
    groups of 16 along the last dim, in FP32, returned in ``x``'s dtype:

    ``s_b = e4m3(min(g · amax_b / 6, 448))``, ``q = rtn(clamp(x / (s_b / g), ±6))`` (the division
    written as vLLM does, ``x · 1/(s_b · 1/g)``), ``x̂ = q · (s_b / g)``. ``g`` is the static
    ``input_global_scale``; a group beyond the calibrated range saturates (scale 448, elements ±6).
    An all-zero group (scale 0) gives zeros. RTN ties to even (SPEC §1), which vLLM's
    ``cast_to_fp4`` thresholds also give."""
    g = global_scale.float().reshape(())
    xg = to_groups(x.float())
    amax_b = xg.abs().amax(-1, keepdim=True)
    s_b = (g * (amax_b * (1.0 / E2M1_MAX))).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    step = s_b * (1.0 / g)
    inv = torch.where(step == 0, torch.zeros_like(step), 1.0 / torch.where(step == 0, 1.0, step))
    q = round_e2m1((xg * inv).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * (s_b / g)).reshape(x.shape).to(x.dtype)


class ServedLinear(nn.Module):
    """``Y = x̂ Ŵᵀ``: a fixed dequantized Ŵ (FP32), and the input quantized by
    :func:`vllm_activation_qdq` when ``global_scale`` is given (W4A4), else left as it is (W4A16)."""

    def __init__(self, weight: torch.Tensor, global_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.float().contiguous())
        self.global_scale = global_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_scale is not None:
            x = vllm_activation_qdq(x, self.global_scale)
        return F.linear(x, self.weight.to(x.dtype))


def served_model(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], mode: str,
                 weights: Mapping[str, NVFP4Tensor] | None = None,
                 input_amax: Mapping[str, torch.Tensor] | None = None) -> Llama:
    """The model as served in ``mode`` (module docstring): the master weights, with every linear of
    ``weights`` (framework name → Ŵ) replaced by a :class:`ServedLinear` for ``w4a16`` and ``w4a4``
    (the latter with ``input_amax``'s scales). Eval mode, CPU."""
    if mode not in MODES:
        raise ValueError(f"unknown serving mode {mode!r}; choose one of {MODES}")
    model = build_model(config["model"], device="cpu")
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith("delayed_amax")}, strict=True)
    if mode == "bf16":
        return model.eval()
    if weights is None or (mode == "w4a4" and input_amax is None):
        raise ValueError(f"mode {mode} needs the exported weights{' and the input amax' if mode == 'w4a4' else ''}")
    for name, t in weights.items():
        g = input_global_scale(input_amax[name]) if mode == "w4a4" else None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, ServedLinear(t.dequantize(), g))
    return model.eval()
