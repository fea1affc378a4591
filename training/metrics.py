"""Throughput, MFU and memory metrics."""

from __future__ import annotations

import resource
import sys

import torch

# Dense BF16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets.
BF16_PEAK_FLOPS = {
    "B200": 2.25e15,
    "B100": 1.75e15,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


def bf16_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The BF16 peak of ``device`` (FLOP/s), ``override`` if given, or None if unknown (CPU)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation against the BF16 peak: ``flops_per_token · tokens/s / peak``."""
    return None if not peak else flops_per_token * tokens_per_second / peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident set size of the process on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
