"""Capture a callable in a CUDA graph, as torch's CUDA-graph notes prescribe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], stream: torch.cuda.Stream | None = None
            ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``fn()`` once (warm-up: lazy initialisation and kernel compilation must not happen
    during capture), then capture one call, both on ``stream`` (default: a new side stream; the
    capture stream cannot be the default one). Returns the graph and what the captured call
    returned (tensors that each ``graph.replay()`` rewrites).

    Run every earlier call of ``fn`` on ``stream`` too when ``fn`` runs a backward: a parameter's
    ``AccumulateGrad`` node can outlive a step, and it keeps the stream of the call that created
    it; if that is the default stream, the capture fails ("operation would make the legacy stream
    depend on a capturing blocking stream", seen on the 1.9b preset)."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out
