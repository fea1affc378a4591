"""Counter-based randomness for the stochastic quantizers (SPEC §2, "Randomness").

Every random draw (Hadamard signs, SR uniforms, MS-EDEN scale uniforms) comes from a fresh
``torch.Generator`` seeded with a hash of

    (run seed, optimizer step, micro-step, layer index, GEMM role, data-parallel rank),

never from global RNG state, so a resumed run replays exactly the draws of an uninterrupted one.
The trainer sets ``(seed, rank)`` once and ``(step, micro_step)`` before every micro-batch with
:func:`set_quant_step`; layers carry their own index and the Function knows the GEMM role.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

ROLES = {"forward": 0, "dgrad": 1, "wgrad": 2}
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One SplitMix64 output step (Steele, Lea & Flood, 2014): a bijective 64-bit mixer."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the integer ``parts`` (order matters)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


@dataclass
class QuantRNGState:
    """The counters the quantizers' draws depend on; saved in every checkpoint."""

    seed: int = 0
    step: int = 0
    micro_step: int = 0
    rank: int = 0


_STATE = QuantRNGState()


def rng_state() -> QuantRNGState:
    return _STATE


def set_quant_rng(seed: int | None = None, rank: int | None = None) -> None:
    """Set the run seed and this process's data-parallel rank."""
    if seed is not None:
        _STATE.seed = int(seed)
    if rank is not None:
        _STATE.rank = int(rank)


def set_quant_step(step: int, micro_step: int = 0) -> None:
    """Set the optimizer step and micro-step whose backward passes draw next."""
    _STATE.step, _STATE.micro_step = int(step), int(micro_step)


@contextmanager
def quant_step(step: int, micro_step: int = 0) -> Iterator[None]:
    """Context manager form of :func:`set_quant_step` that restores the previous counters."""
    old = (_STATE.step, _STATE.micro_step)
    set_quant_step(step, micro_step)
    try:
        yield
    finally:
        _STATE.step, _STATE.micro_step = old


def state_dict() -> dict:
    return asdict(_STATE)


def load_state_dict(state: dict) -> None:
    for k, v in state.items():
        setattr(_STATE, k, int(v))


def generator(layer: int, role: str, device: torch.device | str) -> torch.Generator:
    """The generator for one GEMM of one layer in the current (step, micro-step, rank)."""
    seed = derive_seed(_STATE.seed, _STATE.step, _STATE.micro_step, layer, ROLES[role], _STATE.rank)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
