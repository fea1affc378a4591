"""Capture a callable in a CUDA graph, as torch's CUDA-graph notes prescribe."""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``fn()`` once on a side stream (warm-up: lazy initialisation and kernel compilation
    must not happen during capture), then capture one call. Returns the graph and what the
    captured call returned (tensors that each ``graph.replay()`` rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
