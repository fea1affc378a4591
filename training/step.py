"""One optimizer step of the trainer, run eagerly or replayed as one CUDA graph.

A step is: for each micro-batch, set the quantizers' step key (``quant.randomness``), forward
under BF16 autocast and backward; then the mean loss over ranks, gradient clipping, AdamW and the
step's *health vector* ``[loss, gradient norm, max |p|]`` (:func:`param_max_abs`). The step
returns the health vector on the device and never waits for the GPU: the trainer reads the
vectors of several steps at once, on log, validation and checkpoint steps (training/trainer.py).

With ``cuda_graph`` the whole step (every micro-batch, clipping, AdamW) is captured once in a CUDA
graph after :data:`WARMUP_STEPS` eager steps, and later steps replay it: a small model's step then
costs no host time per kernel (``torch.compile`` alone still launches each kernel from Python).
What changes between steps reaches the graph as data: the batch is copied into static input
buffers, the learning rate into AdamW's tensor ``lr``, and each micro-step's Philox key into the
quantizers' step key (:func:`quant.randomness.step_key`), so a replay computes exactly the step
that an eager call would. A change of the linears' schemes (the late switch to BF16,
:mod:`training.precision_schedule`) is not data: :meth:`TrainStep.precision_changed` drops the
graph, and the step is captured again. :func:`graph_blocker` says when a graph cannot be used, and
:func:`choose_cuda_graph` applies the ``cuda_graph`` setting.

The health check (:class:`PendingHealth`): a non-finite loss, gradient norm or parameter stops
the run at the step where it appears, before anything is saved or logged for that step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from quant import backend as quant_backend
from quant import randomness
from quant.step_weights import quantized_once

from .distributed import all_reduce_max, all_reduce_mean
from .errors import ConfigError

WARMUP_STEPS = 2
"""Eager steps before the capture: the first compiles the kernels and ``torch.compile``'s
graphs, the second runs them once more, as capture requires (nothing may compile during it)."""


def graph_blocker(device: torch.device, fsdp: bool, compile_mode: str, scheme_name: str) -> str | None:
    """Why the step cannot be one CUDA graph here, or None when it can: it needs a CUDA device,
    no FSDP2 (``fsdp``), no cudagraph trees of ``torch.compile`` (``reduce-overhead``,
    ``max-autotune``), and quantizers that draw on the device (the kernels' Philox draws: the
    reference backend and ``NVFP4_DRAWS=torch`` seed a generator on the host per GEMM, which a
    replay would repeat)."""
    if device.type != "cuda":
        return f"it runs on {device.type}, not a CUDA GPU"
    if fsdp:
        return "FSDP2's collectives are not captured in CUDA graphs (FSDP2 runs whenever world size > 1)"
    if compile_mode in ("reduce-overhead", "max-autotune"):
        return f"compile_mode={compile_mode} replays each block as its own CUDA graphs"
    if scheme_name != "bf16":
        if quant_backend.get_backend() == "reference":
            return "the reference quantizers draw their randomness on the host (NVFP4_BACKEND=reference)"
        if quant_backend.get_draws() != "philox":
            return "NVFP4_DRAWS=torch draws the kernels' uniforms from host-seeded generators"
    return None


def choose_cuda_graph(setting: Any, device: torch.device, fsdp: bool, compile: bool, compile_mode: str,
                      scheme_name: str) -> tuple[bool, str | None]:
    """Whether each step replays as one CUDA graph under ``cuda_graph=setting`` (auto, true or
    false), and the line that tells the user which and why (None off CUDA). ``auto`` captures
    compiled steps wherever :func:`graph_blocker` allows; ``true`` forces a capture, and is refused
    (:class:`ConfigError`, with the fix) where the step cannot be captured."""
    blocker = graph_blocker(device, fsdp, compile_mode if compile else "default", scheme_name)
    if setting is True and blocker:
        raise ConfigError(f"cuda_graph=true, but the step cannot be one CUDA graph here: {blocker}. "
                          f"Fix: cuda_graph=auto (or false).")
    if setting == "auto" and blocker is None and not compile:
        blocker = "compile=false (cuda_graph=auto captures compiled steps; cuda_graph=true forces it)"
    use = setting is True or (setting == "auto" and blocker is None)
    line = None
    if setting == "auto" and device.type == "cuda":
        line = ("each step replays as one CUDA graph (cuda_graph=auto)" if use else
                f"steps run without a CUDA graph: {blocker}")
    return use, line


def param_max_abs(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """max |p| over the parameters, over all ranks' shards: finite exactly when every parameter
    is (NaN propagates through the max). One fused pass, no host synchronisation."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    local = [t.detach() for t in local if t.numel()]
    return all_reduce_max(get_total_norm(local, norm_type=math.inf, foreach=True).float())


def first_nonfinite(loss: float, grad_norm: float, param_max: float) -> str | None:
    """What went non-finite first in a step, in the order it is computed, or None."""
    if not math.isfinite(loss):
        return f"the training loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm} (the loss, {loss:.4f}, is finite)"
    if not math.isfinite(param_max):
        return "a parameter is non-finite after the optimizer step (loss and gradient norm are finite)"
    return None


class NonFinite(Exception):
    """Step ``step`` (0-based) went non-finite: ``problem`` says what (:func:`first_nonfinite`)."""

    def __init__(self, step: int, problem: str) -> None:
        super().__init__(f"{problem} at step {step + 1}")
        self.step, self.problem = step, problem


class PendingHealth:
    """The health vectors of the steps run but not yet read: the trainer reads them all at once
    (one wait for the GPU) on log, validation and checkpoint steps."""

    def __init__(self) -> None:
        self.unread: list[tuple[int, float, torch.Tensor]] = []

    def add(self, step: int, lr: float, health: torch.Tensor) -> None:
        self.unread.append((step, lr, health))

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, {train/loss, train/lr, train/grad_norm})`` of each unread step, oldest first;
        :class:`NonFinite` at the first step that has a non-finite value, before any row of it
        or a later step is returned."""
        if not self.unread:
            return []
        values = torch.stack([h for _, _, h in self.unread]).tolist()
        rows = []
        for (step, lr, _), (train_loss, norm, param_max) in zip(self.unread, values):
            if problem := first_nonfinite(train_loss, norm, param_max):
                raise NonFinite(step, problem)
            rows.append((step, {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": norm}))
        self.unread.clear()
        return rows


class TrainStep:
    """The optimizer step of ``model`` and ``optimizer`` (see the module docstring).

    ``accum`` micro-batches of ``micro_batch`` sequences per step; ``autocast``: BF16 autocast;
    ``grad_clip``: the clipping norm; ``fsdp``: gradient synchronisation on the last micro-batch
    only; ``cuda_graph``: capture and replay the step (check :func:`graph_blocker` first);
    ``block_graphs``: the compiled blocks replay as cudagraph trees (``compile_mode``
    ``reduce-overhead``), so each step starts with ``torch.compiler.cudagraph_mark_step_begin()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, accum: int, device: torch.device,
                 autocast: bool, grad_clip: float, fsdp: bool, cuda_graph: bool,
                 block_graphs: bool = False) -> None:
        self.model, self.optimizer, self.accum, self.device = model, optimizer, accum, device
        self.block_graphs = block_graphs
        self.autocast, self.grad_clip, self.fsdp, self.cuda_graph = autocast, grad_clip, fsdp, cuda_graph
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.health: torch.Tensor | None = None
        self.stream = torch.cuda.Stream(device) if cuda_graph else None
        self.inputs: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None
        if cuda_graph:
            # The step's changing values as device tensors the graph reads: AdamW's learning rate
            # and the quantizers' key of each micro-step.
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
                group["capturable"] = True  # AdamW keeps its step counts on the device
            self.keys = torch.zeros(accum, dtype=torch.int64, device=device)
            self.step_key = randomness.step_key(device)

    def __call__(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, lr: float) -> torch.Tensor:
        """Run optimizer step ``step`` on the host batch ``inputs``/``targets`` (``[sequences,
        seq_len]``) at learning rate ``lr``; returns its health vector (on the device, a tensor
        of its own)."""
        self.calls += 1
        if not self.cuda_graph:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return self._run(step, self._to_device(inputs), self._to_device(targets), lambda m: None)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # e.g. a validation that read the weights
        with torch.cuda.stream(side):
            if self.inputs is None:
                self.inputs = torch.empty(inputs.shape, dtype=inputs.dtype, device=self.device)
                self.targets = torch.empty(targets.shape, dtype=targets.dtype, device=self.device)
            self.inputs.copy_(inputs.pin_memory(), non_blocking=True)
            self.targets.copy_(targets.pin_memory(), non_blocking=True)
            for group in self.optimizer.param_groups:
                group["lr"].fill_(lr)
            keys = torch.tensor([randomness.step_key_value(step, m) for m in range(self.accum)],
                                dtype=torch.int64).pin_memory()
            self.keys.copy_(keys, non_blocking=True)
            if self.graph is not None:
                self.graph.replay()
                health = self.health.clone()
            elif self.calls <= WARMUP_STEPS:
                health = self._graph_body(step)
            else:
                health = self._capture(step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        randomness.set_quant_step(step, self.accum - 1)  # the counters an eager step leaves
        return health

    def precision_changed(self) -> None:
        """The linears' schemes changed (a precision switch, :mod:`training.precision_schedule`):
        a captured graph would replay the old GEMMs, so it is dropped, and the next steps run as
        the warm-up of a new capture (:data:`WARMUP_STEPS`, which also let compiled blocks
        recompile), then capture the step again."""
        self.graph, self.health, self.calls = None, None, 0

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # a pinned copy does not wait for the GPU
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _graph_body(self, step: int) -> torch.Tensor:
        def set_key(micro: int) -> None:
            self.step_key.copy_(self.keys[micro:micro + 1])
            randomness.set_quant_counters(step, micro)

        return self._run(step, self.inputs, self.targets, set_key)

    def _capture(self, step: int) -> torch.Tensor:
        """This step as the warm-up of the capture (it trains), then the capture (which does not
        run): later steps replay it."""
        health = self._graph_body(step).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.health = self._graph_body(step)
        self.graph = graph
        return health

    def _run(self, step: int, inputs: torch.Tensor, targets: torch.Tensor,
             set_key: Callable[[int], None]) -> torch.Tensor:
        model, accum = self.model, self.accum
        loss_sum = torch.zeros((), device=self.device)
        with quantized_once(model):  # Ŵ once per step, not per micro-batch (quant/step_weights.py)
            for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
                loss_sum += self._micro_step(step, micro, x, y, set_key)
        loss_mean = all_reduce_mean(loss_sum / accum)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([loss_mean, grad_norm.float(), param_max_abs(model.parameters())])

    def _micro_step(self, step: int, micro: int, x: torch.Tensor, y: torch.Tensor,
                    set_key: Callable[[int], None]) -> torch.Tensor:
        """Forward and backward of micro-batch ``micro``; its loss, detached, in FP32."""
        if micro == 0 and self.block_graphs:
            # Once per optimizer step: a later micro-step's replay would overwrite the graph
            # outputs that the gradients being accumulated still are.
            torch.compiler.cudagraph_mark_step_begin()
        if self.cuda_graph:
            set_key(micro)
        else:
            randomness.set_quant_step(step, micro)
        if self.fsdp:
            self.model.set_requires_gradient_sync(micro == self.accum - 1)
        # autocast's cast cache must be off inside a CUDA graph capture
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast,
                            cache_enabled=not self.cuda_graph):
            loss = self.model(x, y)
        (loss / self.accum).backward()
        return loss.detach().float()
