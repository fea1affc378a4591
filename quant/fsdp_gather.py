"""Weights on the wire in NVFP4: FSDP2 all-gathers a quantized linear's forward Ŵ, not W.

Every scheme's forward quantizes W deterministically (SPEC §3: RTN along in-features in 1×16
groups, or in 16×16 tiles, with or without 4/6), with one tensor scale from the whole weight's
amax (SPEC §2: ``s_t = amax(W) / (6 · 448)``, ``6 · 256`` under 4/6). FSDP2 shards W by rows.
So each rank can quantize its own rows with the whole weight's amax (all-reduced with MAX over
the shard group) and get exactly those rows of Ŵ: a 1×16 group lies within a row, and a 16×16
tile within a shard whose row count is a multiple of 16. FSDP2 then all-gathers the packed
codes and E4M3 block scales, 4.5 bits per value (4.03 with 16×16 tiles) instead of 16 in BF16,
and the gathered rows are Ŵ, bit for bit (:class:`~quant.gathered.GatheredNVFP4Weight`). This
uses FSDP2's all-gather extension on a tensor subclass (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the sharded parameter's local tensor, as torchao's float8 training
does).

The backward needs nothing more: in every preset dgrad's weight operand is the forward's Ŵ
(``source="quantized"``: nvidia and four_over_six multiply by Ŵ itself, tetrajet_v2 and
quartet2 rotate and re-quantize it), and wgrad reads X and E, not W. A scheme whose dgrad read
W in high precision would keep the BF16 gather (:func:`fallback_reason`).

Once per optimizer step: a shard is quantized again only after its values have changed, which
every in-place operation on it (or on a view of it) marks: the optimizer's update, a checkpoint
load. The forwards of all micro-batches, the backward's re-gathers and the validation after the
step reuse it. :func:`refresh` quantizes every stale shard of a model at a step's start with
one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from .format import GROUP, PackedNVFP4
from .gathered import GatheredNVFP4Weight
from .linear import QuantLinear, quantize_forward_weight
from .schemes import Scheme

aten = torch.ops.aten

WEIGHT_GATHERS = ("bf16", "nvfp4")

# Operations whose result is (a part of) the weight itself, so it stays a shard of a weight
# gathered as Ŵ: those FSDP2 applies when sharding and materializing (torchao's float8 weights
# keep the same). Views share the shard's quantized form; new tensors start without one.
_VIEWS = {aten.slice.Tensor, aten.view.default, aten.as_strided.default, aten.split.Tensor,
          aten.split_with_sizes.default, aten.alias.default, aten.detach.default}
_NEW = {aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default,
        aten._to_copy.default, aten.clone.default}


class _Quantized:
    """The quantized form of a shard, shared by the shard and its views (a write to any of
    them clears it)."""

    packed: PackedNVFP4 | None = None


class NVFP4ShardedWeight(torch.Tensor):
    """The local shard (rows) of a quantized linear's weight W, in high precision (``hp``),
    which FSDP2 all-gathers as its forward NVFP4 form (module docstring). Every operation acts
    on ``hp``; the optimizer's update and a checkpoint load change it in place."""

    hp: torch.Tensor
    scheme: Scheme
    gather_dtype: torch.dtype | None

    @staticmethod
    def __new__(cls, hp: torch.Tensor, scheme: Scheme, gather_dtype: torch.dtype | None,
                quantized: _Quantized | None = None) -> NVFP4ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, hp.shape, strides=hp.stride(), storage_offset=hp.storage_offset(), dtype=hp.dtype,
            device=hp.device, requires_grad=hp.requires_grad)

    def __init__(self, hp: torch.Tensor, scheme: Scheme, gather_dtype: torch.dtype | None,
                 quantized: _Quantized | None = None) -> None:
        self.hp, self.scheme, self.gather_dtype = hp, scheme, gather_dtype
        self._q = quantized or _Quantized()
        self.group: dist.ProcessGroup | None = None  # FSDP2's shard group, from its first all-gather

    def __repr__(self) -> str:
        return f"NVFP4ShardedWeight({self.hp!r}, scheme={self.scheme.name})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["hp"], (self.scheme, self.gather_dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size, outer_stride):
        return NVFP4ShardedWeight(inner["hp"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shards = [a for a in _flat(args) if isinstance(a, NVFP4ShardedWeight)]
        out = func(*tree_map_only(NVFP4ShardedWeight, lambda t: t.hp, args),
                   **tree_map_only(NVFP4ShardedWeight, lambda t: t.hp, kwargs))
        if func._schema.is_mutable:
            for shard in shards:
                shard._q.packed = None
            return args[0] if isinstance(args[0], NVFP4ShardedWeight) else out
        like = shards[0]
        if func in _VIEWS:
            return tree_map_only(torch.Tensor, lambda t: like._alike(t, like._q), out)
        if func in _NEW:
            return tree_map_only(torch.Tensor, lambda t: like._alike(t, None), out)
        return out

    def _alike(self, hp: torch.Tensor, quantized: _Quantized | None) -> NVFP4ShardedWeight:
        return NVFP4ShardedWeight(hp, self.scheme, self.gather_dtype, quantized)

    @property
    def stale(self) -> bool:
        """Whether the values were written since they were last quantized (or never were)."""
        return self._q.packed is None

    def quantized(self, group: dist.ProcessGroup | None) -> PackedNVFP4:
        """This shard's rows of Ŵ, from the shard cast to ``gather_dtype`` (FSDP2's
        ``param_dtype``; None: its own), quantized once per version of its values
        (:func:`refresh`)."""
        if self.stale:
            refresh([self], group)
        assert self._q.packed is not None
        return self._q.packed

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if mp_policy.param_dtype not in (None, self.gather_dtype):
            raise ValueError(f"{self!r} was made for FSDP2 gathers in {self.gather_dtype}, not in "
                             f"{mp_policy.param_dtype}: install it with the module's mixed-precision policy")
        self.group = mesh.get_group()
        q = self.quantized(self.group)
        return (q.data, q.scales), (q.tensor_scale, q.tile)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scales = all_gather_outputs
        tensor_scale, tile = metadata
        if out is not None:  # FSDP2 gathered into the storage of the weight it built before;
            out.tensor_scale = tensor_scale.clone()  # a new one: the old may be saved for backward
            return None
        w = GatheredNVFP4Weight(codes, scales, tensor_scale.clone(), tile, param_dtype, self.scheme.forward.b, self)
        return w, (codes, scales)


def _flat(args: Any) -> Iterable[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def whole_amax(shards: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The amax of each weight whose rows ``shards`` hold on this rank, over all ranks of
    ``group``: ``max |W|`` as :func:`quant.quantizers.amax_of` gives it for the whole weight
    (NaN when any rank's rows hold a NaN). One all-reduce for all of them."""
    local = torch.stack([s.abs().amax().float() for s in shards])
    nan = local.isnan()
    both = torch.stack([torch.where(nan, 0.0, local), nan.float()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return torch.where(both[1] > 0, float("nan"), both[0])


@torch.no_grad()
def refresh(shards: list[NVFP4ShardedWeight], group: dist.ProcessGroup | None) -> int:
    """Quantize those of ``shards`` whose values changed since they were last quantized, with
    one all-reduce for their amaxes (collective: every rank of ``group`` calls it with its
    shards of the same weights, in the same order); returns how many were. Rows ``r`` of W
    become rows ``r`` of Ŵ (module docstring)."""
    stale = [s for s in shards if s.stale]
    if not stale:
        return 0
    values = [s.hp if s.gather_dtype is None else s.hp.to(s.gather_dtype) for s in stale]
    for s, w, amax in zip(stale, values, whole_amax(values, group)):
        q = quantize_forward_weight(w, s.scheme, amax=amax)
        assert q is not None
        s._q.packed = q.pack()
    return len(stale)


def refresh_model(model: nn.Module) -> int:
    """:func:`refresh` every NVFP4-gathered weight shard of ``model`` (at an optimizer step's
    start, so that the step's all-gathers find them quantized); returns how many were stale."""
    params = [p for p in model.parameters()
              if isinstance(p, DTensor) and isinstance(p._local_tensor, NVFP4ShardedWeight)]
    if not params:
        return 0
    mesh = params[0].device_mesh
    return refresh([p._local_tensor for p in params], mesh.get_group(mesh.ndim - 1))


def fallback_reason(layer: QuantLinear, shards: int) -> str | None:
    """Why ``layer``'s weight must be all-gathered in BF16 over ``shards`` ranks, or None when
    its forward Ŵ can travel instead (module docstring)."""
    s = layer.scheme
    if s.forward.b.quantizer == "none":
        return "its forward weight is not quantized"
    if s.delayed_amax:
        return "delayed_amax takes its tensor scale from the previous call, not the weight's values"
    if not s.saves_quantized_w:
        return "its dgrad reads W in high precision"
    rows = GROUP if s.forward.b.quantizer == "rtn_2d" else 1
    n = layer.out_features
    if n % (rows * shards):
        what = "16-row tiles" if rows > 1 else "rows"
        return (f"out_features={n} does not split into {shards} equal shards of whole {what} "
                f"(a multiple of {rows * shards} would)")
    return None


def install(model: nn.Module, shards: int, gather_dtype: torch.dtype | None) -> list[tuple[str, str]]:
    """Make each quantized linear of ``model`` (before ``fully_shard``) all-gather its forward
    Ŵ over ``shards`` ranks, where :func:`fallback_reason` allows, quantized from W in
    ``gather_dtype`` (the FSDP2 mixed-precision ``param_dtype``; None: W's own dtype); returns
    ``(layer, reason)`` for the layers that keep the BF16 gather."""
    kept = []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        why = fallback_reason(m, shards)
        if why is not None:
            kept.append((name, why))
            continue
        w = m.weight
        m.weight = nn.Parameter(NVFP4ShardedWeight(w.detach(), m.scheme, gather_dtype),
                                requires_grad=w.requires_grad)
    return kept


def plain_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata) -> None:
    """A state-dict hook: each NVFP4-gathered weight appears as W (a DTensor of plain shards),
    so checkpoints hold the same tensors as under the BF16 gather."""
    del module, prefix, local_metadata
    for k, v in state_dict.items():
        if isinstance(v, DTensor) and isinstance(v._local_tensor, NVFP4ShardedWeight):
            state_dict[k] = DTensor.from_local(v._local_tensor.hp, v.device_mesh, v.placements,
                                               run_check=False, shape=v.shape, stride=v.stride())


def gathered_bytes(model: nn.Module, shards: int, param_bytes: int, weight_gather: str) -> dict[str, int]:
    """Bytes of one all-gather of every parameter of ``model`` (a model converted by
    ``quant.quantize_model``, on any device, meta included) over ``shards`` ranks:
    ``quantized_linears`` (their weights: 4 bits a value plus an E4M3 scale per 1×16 group or
    16×16 tile under ``nvfp4`` where :func:`fallback_reason` allows, else ``param_bytes`` a
    value) and ``other`` (every other parameter, ``param_bytes`` a value). FSDP2 all-gathers
    each parameter before every forward and again before every backward (``reshard_after_forward``)."""
    if weight_gather not in WEIGHT_GATHERS:
        raise ValueError(f"unknown weight_gather {weight_gather!r}; choose one of {WEIGHT_GATHERS}")
    linear, other = 0, 0
    quantized = {id(m.weight): m for m in model.modules() if isinstance(m, QuantLinear)}
    for p in model.parameters():
        m = quantized.get(id(p))
        if m is None:
            other += p.numel() * param_bytes
        elif weight_gather == "nvfp4" and fallback_reason(m, shards) is None:
            per_scale = GROUP * GROUP if m.scheme.forward.b.quantizer == "rtn_2d" else GROUP
            linear += p.numel() // 2 + p.numel() // per_scale
        else:
            linear += p.numel() * param_bytes
    return {"quantized_linears": linear, "other": other}
