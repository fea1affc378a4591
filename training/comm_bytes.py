"""Bytes that this rank's collectives move, counted as c10d dispatches them.

A ``TorchDispatchMode`` sees every c10d collective op with its tensors, whichever backend (gloo,
NCCL) runs it. Counted per kind: an all-gather by its output (the whole gathered buffer, ``s``
shards), a reduce-scatter by its input, an all-reduce by its tensor. FSDP2 gathers a block's
parameters as one flat buffer, so a count covers whatever the buffer holds: BF16 values, or
NVFP4 codes and scales (``parallel.weight_gather``, :mod:`quant.fsdp_gather`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Within the block, ``bytes[kind]`` sums what each collective of that kind moved
    (module docstring) and ``calls[kind]`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            kind = next((k for op, k in _KINDS.items() if op in name), None)
            if kind is not None:
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(args[0] if kind in ("all_gather", "all_reduce") else args[1])
        return func(*args, **(kwargs or {}))
