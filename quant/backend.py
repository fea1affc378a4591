"""Backend choice: the pure-PyTorch reference, the fused Triton kernels, or native NVFP4 GEMMs.

``auto`` (default) runs native NVFP4 GEMMs on a Blackwell GPU (compute capability 10.x or 12.x,
:mod:`quant.native`: the kernels quantize, the FP4 tensor cores multiply), the kernels with
emulated GEMMs on any other CUDA GPU, and the reference everywhere else. ``reference``,
``triton`` and ``native`` force one (``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``
set before :mod:`quant.kernels` is first imported; ``native`` elsewhere than on Blackwell is
refused with the reason, except under :func:`quant.native.simulated`). Set it with :func:`set_backend` or the
environment variable ``NVFP4_BACKEND``, read when a backend is chosen (each quantization), not at
import. :func:`set_auto_families` narrows the kernel families that ``auto`` runs.

Random draws of the kernel path (``NVFP4_DRAWS`` / :func:`set_draws`):

* ``philox`` (default): one int64 seed per stochastic operand is drawn from the layer's
  ``quant.randomness`` generator (after the rotation signs, A before B, as the reference draws
  its uniforms) and the kernels draw ``tl.rand(seed, offset)``; still a pure function of
  (seed, step, micro-step, layer, role, rank), but a different stream from the reference.
* ``torch``: the kernels get the very uniform tensors the reference draws
  (``torch.rand(..., generator=gen)``), so the Triton path is bit-identical to the reference
  path end to end (tests); slower, as it materialises one FP32 draw per element.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

BACKENDS = ("auto", "reference", "triton", "native")
DRAWS = ("philox", "torch")

_backend: str | None = None
_draws: str | None = None
_triton_ok: bool | None = None


def _checked(name: str, allowed: tuple[str, ...], what: str) -> str:
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}; choose one of {allowed}")
    return name


def set_backend(name: str | None) -> None:
    """``"auto"``, ``"reference"``, ``"triton"`` or ``"native"``; ``None`` goes back to
    ``NVFP4_BACKEND``/auto."""
    global _backend
    _backend = None if name is None else _checked(name, BACKENDS, "quantizer backend")


def get_backend() -> str:
    """The backend in use: the last :func:`set_backend`, else ``NVFP4_BACKEND``, else ``auto``."""
    name = _backend if _backend is not None else os.environ.get("NVFP4_BACKEND", "auto")
    return _checked(name, BACKENDS, "quantizer backend (NVFP4_BACKEND)")


def set_draws(name: str | None) -> None:
    """``"philox"`` or ``"torch"`` (see the module docstring); ``None``: ``NVFP4_DRAWS``/philox."""
    global _draws
    _draws = None if name is None else _checked(name, DRAWS, "draw mode")


def get_draws() -> str:
    """The draw mode in use: the last :func:`set_draws`, else ``NVFP4_DRAWS``, else ``philox``."""
    name = _draws if _draws is not None else os.environ.get("NVFP4_DRAWS", "philox")
    return _checked(name, DRAWS, "draw mode (NVFP4_DRAWS)")


@contextmanager
def use_backend(name: str, draws: str | None = None) -> Iterator[None]:
    """Temporarily force a backend (and draw mode)."""
    old = (_backend, _draws)
    set_backend(name)
    if draws is not None:
        set_draws(draws)
    try:
        yield
    finally:
        set_backend(old[0])
        set_draws(old[1])


def triton_available() -> bool:
    """Whether triton imports (checked once)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401

            _triton_ok = True
        except ImportError:
            _triton_ok = False
    return _triton_ok


FAMILIES = ("rtn", "sr", "rht", "eden", "packed")
"""Kernel families: ``rtn`` (RTN 1×16 / 16×16, ±4/6), ``sr``, ``rht`` (Hadamard rotation followed
by RTN or SR), ``eden`` (rotation + MS-EDEN) and ``packed`` (quantizing straight from a saved
packed operand). ``auto`` runs all of them on CUDA by default, each verified bit-exact against
the reference on the H200 (docs/performance.md, "Correctness")."""

_auto_families: tuple[str, ...] = FAMILIES


def set_auto_families(families: tuple[str, ...] | list[str] | None) -> None:
    """The kernel families (:data:`FAMILIES`) that ``auto`` runs on CUDA, e.g. ``("rtn", "sr")``
    to leave the others to the reference (whose operands still get the kernels' Philox draws);
    ``None``: all of them."""
    global _auto_families
    fams = FAMILIES if families is None else tuple(families)
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown kernel families {bad}; choose from {FAMILIES}")
    _auto_families = fams


def auto_families() -> tuple[str, ...]:
    """The kernel families that ``auto`` runs on CUDA (:func:`set_auto_families`)."""
    return _auto_families


def use_triton(t: torch.Tensor, family: str | None = None) -> bool:
    """Whether the quantization of ``t`` runs on the Triton kernels (``family``: which kernel
    family would run it, see :data:`FAMILIES`; ``auto`` only uses :func:`auto_families`)."""
    name = get_backend()
    if name == "reference":
        return False
    if name == "triton":
        return True
    if name == "native":  # the kernels quantize on the GPU; a simulated run elsewhere uses the reference
        return t.is_cuda and triton_available()
    return t.is_cuda and triton_available() and (family is None or family in auto_families())


def use_native(t: torch.Tensor) -> bool:
    """Whether the GEMMs on ``t``'s device run natively in NVFP4 (:mod:`quant.native`):
    ``native`` (a RuntimeError naming the reason and the fix where it cannot), or ``auto`` on a
    Blackwell GPU whose torch has the NVFP4 interface."""
    from . import native

    name = get_backend()
    if name == "native":
        reason = native.unavailable_reason(t.device)
        if reason is not None:
            raise RuntimeError(
                f"NVFP4_BACKEND=native cannot run here: {reason}. Fix: NVFP4_BACKEND=auto "
                "(native on Blackwell, else the Triton kernels with emulated GEMMs on a GPU, "
                "the reference on CPU) or NVFP4_BACKEND=triton."
            )
        return True
    return name == "auto" and t.is_cuda and triton_available() and native.unavailable_reason(t.device) is None


def describe(device: torch.device) -> str:
    """One line saying how the quantized linears run on ``device`` under the current backend
    (for a run's first lines). Raises as :func:`use_native` does where ``native`` cannot run."""
    t = torch.empty(0, device=device)
    if use_native(t):
        return ("quantization: Triton kernels; GEMMs: native NVFP4 on the FP4 tensor cores "
                "(checked by simulation, not on this hardware: docs/performance.md)")
    if use_triton(t):
        return "quantization: Triton kernels; GEMMs: emulated in BF16 with FP32 accumulation"
    return "quantization: reference (pure PyTorch); GEMMs: emulated with FP32 accumulation"
