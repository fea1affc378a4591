"""Parallelism applied outside the model, in a fixed order (torchtitan's layout).

:func:`parallelize` takes a model built on the meta device (already converted by
``quant.quantize_model``) and applies, in this order:

1. activation checkpointing per block: ``none``, ``full`` (every block) or ``selective`` (every
   ``ac_every``-th block);
2. ``torch.compile`` per block;
3. FSDP2 ``fully_shard`` per block, then on the root, with a mixed-precision policy (BF16
   parameters, FP32 gradient reduction) when training in BF16. A 2-D mesh
   ``(replicate, shard)`` gives HSDP: replicate across nodes, shard within a node. With
   ``weight_gather="nvfp4"`` the quantized linears' weights travel as their forward NVFP4 form
   (:mod:`quant.fsdp_gather`), bit-identical to gathering them in BF16.

:func:`materialize` then allocates the (sharded) parameters on the device and initialises them
with :func:`init_parameters`: each parameter is generated whole from its own seeded generator and
each rank keeps its shard, so the values do not depend on the number of ranks and no rank ever
holds the whole model.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from quant import QuantLinear, fsdp_gather
from quant import backend as quant_backend
from quant import randomness as quant_randomness
from quant.randomness import derive_seed

AC_MODES = ("none", "full", "selective")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that replay each compiled block as CUDA graphs (cudagraph trees)."""


def replays_cuda_graphs(compile: bool, compile_mode: str) -> bool:
    """Whether the compiled blocks replay as CUDA graphs. A model call whose predecessor's graph
    outputs are consumed then starts with ``torch.compiler.cudagraph_mark_step_begin()``."""
    return bool(compile) and compile_mode in CUDA_GRAPH_MODES


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter name without the prefixes that checkpoint wrappers and compile insert."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> None:
    """Wrap blocks in ``checkpoint_wrapper``: all of them (``full``) or every ``every``-th
    (``selective``). Forward quantization is deterministic, so recomputation is exact."""
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {AC_MODES}")
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        if mode == "full" or i % every == 0:
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, mode: str = "default") -> None:
    """Compile each block separately (the blocks are identical, so one compilation serves all),
    in ``torch.compile``'s ``mode``. Whether triton imports is decided first: traced while still
    undecided, it made every compiled block recompile once after its first call (a guard on the
    cached answer, seen with ``TORCH_LOGS=recompiles`` on an H200, 2026-12-02)."""
    quant_backend.triton_available()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, mode=mode)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, bf16_params: bool, reshard_after_forward: bool = True,
               weight_gather: str = "bf16") -> list[str]:
    """FSDP2 on every block, then on the root (embedding, final norm, lm_head). With
    ``weight_gather="nvfp4"``, the quantized linears that can all-gather their forward Ŵ do
    (:func:`quant.fsdp_gather.install`); returns a line for each that cannot, naming it."""
    if weight_gather not in fsdp_gather.WEIGHT_GATHERS:
        raise ValueError(f"unknown parallel.weight_gather {weight_gather!r}; choose one of "
                         f"{fsdp_gather.WEIGHT_GATHERS}")
    lines = []
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_params
          else MixedPrecisionPolicy())
    if weight_gather == "nvfp4":
        for name, why in fsdp_gather.install(model, mesh.size(mesh.ndim - 1), mp.param_dtype):
            lines.append(f"weight_gather=nvfp4: {canonical_name(name)} is all-gathered in BF16: {why}")
        model._register_state_dict_hook(fsdp_gather.plain_state_dict_hook)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return lines


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    activation_checkpointing: str = "none",
    ac_every: int = 2,
    compile: bool = False,
    compile_mode: str = "default",
    bf16_params: bool = True,
    weight_gather: str = "bf16",
) -> list[str]:
    """Apply activation checkpointing, compile and FSDP2 in that order (see module docstring);
    returns lines for the run's log (:func:`apply_fsdp`).

    ``mesh=None`` (one process) skips FSDP. ``compile_mode`` is ``torch.compile``'s mode; the
    CUDA-graph modes (:data:`CUDA_GRAPH_MODES`) serve one process only. ``weight_gather``: what
    FSDP2 all-gathers of a quantized linear's weight, ``bf16`` (W in the parameter dtype) or
    ``nvfp4`` (its forward Ŵ, :mod:`quant.fsdp_gather`).
    """
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile_mode {compile_mode!r}; choose one of {COMPILE_MODES}")
    if replays_cuda_graphs(compile, compile_mode) and mesh is not None:
        raise ValueError(
            f"compile_mode={compile_mode} replays the compiled blocks as CUDA graphs, which FSDP2's "
            f"collectives do not support. Fix: compile_mode=default (or max-autotune-no-cudagraphs) "
            f"when training on more than one GPU."
        )
    apply_activation_checkpointing(model, activation_checkpointing, ac_every)
    if compile:
        apply_compile(model, compile_mode)
    if mesh is None:
        return []
    return apply_fsdp(model, mesh, bf16_params, weight_gather=weight_gather)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """SPEC §4 init that is independent of sharding and wrapping.

    Parameter ``name`` is drawn whole from a generator seeded with ``(seed, crc32(name))`` on the
    parameter's device, using the model's ``init_plan`` (std, or None for ones); a sharded
    (DTensor) parameter keeps its local shard.
    """
    plan = {canonical_name(k): v for k, v in model.init_plan().items()}
    for name, p in model.named_parameters():
        key = canonical_name(name)
        std = plan[key]
        device = p.device
        full = torch.empty(p.shape, dtype=p.dtype, device=device)
        if std is None:
            full.fill_(1.0)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(derive_seed(seed, zlib.crc32(key.encode())))
            full.normal_(0.0, std, generator=g)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
        else:
            p.copy_(full)


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate a meta-device (possibly sharded) model on ``device`` and initialise it (and the
    quantizers' step key on ``device``, :func:`quant.randomness.step_key`)."""
    model.to_empty(device=device)
    init_parameters(model, seed)
    model.init_buffers()
    # The quantizers' device-side Philox key exists before any (compiled) forward: created
    # inside a traced backward it would break the graph.
    quant_randomness.step_key(device)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.reset_buffers()
    return model
