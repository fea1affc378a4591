"""A model, not a measurement, of a pre-training run's time on many GPUs (docs/scaling.md).

Inputs: one GPU's measured tokens/s (train.py under FSDP2 on one rank, ``scripts/bench_train.py
--fsdp``), the model's parameter count, and stated link bandwidths. The step as model/parallel.py
runs it: ``fully_shard`` per block and on the root, BF16 parameters, FP32 gradient reduction,
``reshard_after_forward``, gradients synchronised on the last micro-batch only. Per rank and step:

- all-gathers: every parameter twice per micro-batch (before the forward and again before the
  backward), ``2 · accum · G · (s − 1)/s`` for a shard group of ``s`` ranks, where ``G`` is the
  bytes of one gather of the whole model: ``2 B · P`` in BF16, less under
  ``parallel.weight_gather=nvfp4``, whose quantized linears travel as their forward Ŵ, 4.5 bits
  a value (4.03 with 16×16 tiles; :func:`gather_bytes`);
- reduce-scatter: the gradients once, ``4 B · P · (s − 1)/s``;
- HSDP (``parallel.replicate = n`` nodes, shards within a node): also an all-reduce of each
  rank's gradient shard over the ``n`` replicas, ``2 · 4 B · (P / s) · (n − 1)/n``.

A collective over ranks of several nodes runs at the per-GPU network bandwidth, one within a
node at NVLink's. Compute is ``tokens per rank and step / measured tokens/s``; FSDP2 prefetches
the next all-gather during compute, so the step takes ``max(compute, communication)``: an
optimistic bound (perfect overlap, no straggler, per-GPU speed kept at smaller micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """Bandwidths one rank gets in a ring collective, in bytes/s."""

    nvlink: float
    network: float


@dataclass(frozen=True)
class Step:
    """One optimizer step on ``gpus`` ranks: its parts in seconds, and the bytes per rank."""

    gpus: int
    layout: str
    accum: int
    compute_s: float
    comm_s: float
    gathered_bytes: float
    reduced_bytes: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.comm_s else "communication"


def parameter_count(preset: dict) -> int:
    """All parameters of a model preset (built on the meta device)."""
    from model import build_model

    model = build_model(preset, device="meta")
    return sum(p.numel() for p in model.parameters())


def gather_bytes(preset: dict, scheme: str, weight_gather: str, shards: int) -> dict[str, int]:
    """``G`` in parts, ``quantized_linears`` and ``other``: the bytes of one all-gather of a
    preset's parameters (BF16 parameters) under ``scheme``, over ``shards`` ranks
    (:func:`quant.fsdp_gather.gathered_bytes`, which tests/test_distributed.py checks against
    c10d's own all-gathers)."""
    import quant
    from model import build_model
    from quant.fsdp_gather import gathered_bytes

    model = quant.quantize_model(build_model(preset, device="meta"), scheme)
    return gathered_bytes(model, shards, 2, weight_gather)


def step(params: int, tokens_per_s: float, *, gpus: int, gpus_per_node: int, batch: int, seq_len: int,
         micro_batch: int, links: Links, hsdp: bool, gather: int | None = None) -> Step:
    """The modelled step (module docstring) of ``batch`` sequences of ``seq_len`` tokens;
    ``gather``: ``G``, the bytes of one all-gather of the model (None: ``2 B · params``)."""
    per_rank = batch // gpus
    if per_rank < 1 or batch % gpus:
        raise ValueError(f"a batch of {batch} sequences does not split over {gpus} GPUs")
    accum = max(1, per_rank // micro_batch)
    compute = per_rank * seq_len / tokens_per_s
    nodes = max(1, gpus // gpus_per_node)
    shard = gpus_per_node if hsdp and nodes > 1 else gpus
    shard_bw = links.nvlink if shard <= gpus_per_node else links.network
    frac = (shard - 1) / shard
    gathered = 2 * accum * (2 * params if gather is None else gather) * frac
    reduced = 4 * params * frac
    comm = (gathered + reduced) / shard_bw
    if shard < gpus:  # HSDP: all-reduce of the gradient shard over the node replicas
        replica_bytes = 2 * 4 * params / shard * (nodes - 1) / nodes
        reduced += replica_bytes
        comm += replica_bytes / links.network
    return Step(gpus, "HSDP" if shard < gpus else "FSDP", accum, compute, comm, gathered, reduced)
