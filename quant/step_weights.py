"""The forward's quantized weights, quantized once per optimizer step.

Every scheme's forward quantizes W with a deterministic quantizer (RTN along in-features, or in
16×16 tiles, with or without 4/6 selection; SPEC §3), and W does not change between the
micro-batches of one optimizer step. So Ŵ is the same for every micro-batch, and quantizing it
once, when the step starts, gives the very GEMM operands of quantizing it in each micro-batch's
forward: the step is bit-identical, with one weight quantization per step instead of one per
micro-batch. The backward reads the same Ŵ where the scheme says so (nvidia's dgrad; tetrajet_v2
and quartet2 rotate and re-quantize it stochastically, with draws of each micro-step, so that
quantization stays per micro-batch).

Not cached here: layers under ``delayed_amax`` (their forward's tensor scale is the previous
call's amax, which changes after the first micro-batch), and FSDP-sharded weights (outside a
block's forward a rank holds only its shard). Those that FSDP2 all-gathers as Ŵ
(``parallel.weight_gather=nvfp4``) are quantized once per step as shards instead
(:mod:`quant.fsdp_gather`), which :func:`quantized_once` starts with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import fsdp_gather
from .format import PackedNVFP4
from .linear import QuantLinear, quantize_forward_weight
from .schemes import Scheme


def caches_forward_weight(scheme: Scheme) -> bool:
    """Whether a layer under ``scheme`` quantizes its forward Ŵ once per step (module docstring)."""
    return scheme.forward.b.quantizer != "none" and not scheme.delayed_amax


def forward_weight(weight: torch.Tensor, scheme: Scheme) -> PackedNVFP4:
    """Ŵ, W quantized by the scheme's forward weight quantizer, packed (SPEC §1): what the
    forward GEMM computes with (:func:`quant.linear.quantized_gemm`)."""
    return quantize_forward_weight(weight, scheme).pack()


def _cached_layers(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules()
            if isinstance(m, QuantLinear) and caches_forward_weight(m.scheme)
            and not isinstance(m.weight, DTensor)]


@contextmanager
def quantized_once(model: nn.Module) -> Iterator[int]:
    """Within the block, each cached layer of ``model`` computes with the Ŵ quantized on entry;
    yields the number of such layers. Only for the micro-batches of one optimizer step: W must
    not change inside. The shards that FSDP2 gathers as Ŵ are quantized on entry too
    (:func:`quant.fsdp_gather.refresh_model`)."""
    fsdp_gather.refresh_model(model)
    layers = _cached_layers(model)
    for layer in layers:
        layer.step_weight = forward_weight(layer.weight, layer.scheme)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.step_weight = None
