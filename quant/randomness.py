"""Counter-based randomness for the stochastic quantizers (SPEC §2, "Randomness").

Every random draw (Hadamard signs, SR uniforms, MS-EDEN scale uniforms) is a pure function of

    (run seed, optimizer step, micro-step, layer index, GEMM role, data-parallel rank),

never of global RNG state, so a resumed run replays exactly the draws of an uninterrupted one.
The trainer sets ``(seed, rank)`` once and ``(step, micro_step)`` before every micro-batch with
:func:`set_quant_step`; layers carry their own index and the Function knows the GEMM role.

Two generators implement it:

* the reference path draws from a fresh ``torch.Generator`` per (layer, role), seeded with a
  hash of all six (:func:`generator`);
* the kernels draw Philox numbers keyed by the *layer key* ``step_key XOR layer_tag``
  (:func:`layer_key`): the step key ``hash(seed, step, micro-step, rank)`` lives in a
  one-element device tensor per device (:func:`step_key`; refilled, without a host sync,
  whenever the counters change), the layer's tag ``hash(layer)`` in a buffer of its layer
  (:func:`layer_ids`), and the stream number :func:`stream` of (role, operand) is the second
  counter word. Nothing is created per GEMM and the draws are read on the device, so a captured
  CUDA graph of a step replays with the next step's draws; and the layer index reaches the
  kernels as data, so ``torch.compile`` traces every block as the same graph (an integer would
  be specialised on, one recompilation per layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

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


_KEYS: dict[torch.device, torch.Tensor] = {}
# Stream numbers: 4 per role: the GEMM's A operand, its B operand, its rotation signs.
OPERAND_STREAMS = {"a": 0, "b": 1, "signs": 2}


def _step_key_value() -> int:
    return step_key_value(_STATE.step, _STATE.micro_step)


def step_key_value(step: int, micro_step: int) -> int:
    """The step key's value at (``step``, ``micro_step``) of this run's seed and rank: what
    :func:`set_quant_step` fills :func:`step_key` with (for a caller that fills it on the device,
    as a replayed CUDA graph of a whole step does, ``training.step``)."""
    return derive_seed(_STATE.seed, step, micro_step, _STATE.rank)


def _refresh_keys() -> None:
    value = _step_key_value()
    for key in _KEYS.values():
        key.fill_(value)


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index (``cuda`` → ``cuda:0``), so that ``materialize(model, "cuda")``
    and a tensor on ``cuda:0`` share one key: a key first created inside a compiled region
    breaks its graph."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu" and device.type != "meta":
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def step_key(device: torch.device | str) -> torch.Tensor:
    """The kernels' Philox key for the current (seed, step, micro-step, rank) on ``device``: an
    int64 tensor of one element, the same tensor for the whole run (refilled in place)."""
    device = _indexed(device)
    key = _KEYS.get(device)
    if key is None:
        key = _KEYS[device] = torch.full((1,), _step_key_value(), dtype=torch.int64, device=device)
    return key


@dataclass(frozen=True)
class PhiloxStream:
    """The kernels' draws of one operand (or of one GEMM's signs): Philox key and stream."""

    key: torch.Tensor
    stream: int


def stream(role: str, operand: str) -> int:
    """The kernels' Philox stream of one operand's draws (``"a"``, ``"b"``) or of the rotation
    signs (``"signs"``) of one GEMM (the layer is in the key, :func:`layer_key`)."""
    return ROLES[role] * 4 + OPERAND_STREAMS[operand]


def layer_ids(layer: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A layer's identity as data: int64 ``[layer, tag]``, ``tag = hash(layer)`` (63 bits)."""
    return torch.tensor([layer, derive_seed(layer)], dtype=torch.int64, device=device)


_LAYER_IDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def cached_layer_ids(layer: int, device: torch.device | str) -> torch.Tensor:
    """:func:`layer_ids` made once per (layer, device) and reused (so that a call inside a CUDA
    graph capture copies nothing from the host)."""
    device = _indexed(device)
    ids = _LAYER_IDS.get((layer, device))
    if ids is None:
        ids = _LAYER_IDS[layer, device] = layer_ids(layer, device)
    return ids


def layer_key(ids: torch.Tensor) -> torch.Tensor:
    """The kernels' Philox key of one layer (:func:`layer_ids`) in the current (seed, step,
    micro-step, rank): ``step_key XOR tag``, computed on the device (one element)."""
    return torch.bitwise_xor(step_key(ids.device), ids[1:])


def set_quant_rng(seed: int | None = None, rank: int | None = None) -> None:
    """Set the run seed and this process's data-parallel rank."""
    if seed is not None:
        _STATE.seed = int(seed)
    if rank is not None:
        _STATE.rank = int(rank)
    _refresh_keys()


def set_quant_step(step: int, micro_step: int = 0) -> None:
    """Set the optimizer step and micro-step whose backward passes draw next."""
    _STATE.step, _STATE.micro_step = int(step), int(micro_step)
    _refresh_keys()


def set_quant_counters(step: int, micro_step: int) -> None:
    """Set the counters as :func:`set_quant_step` does, but leave the device keys as they are
    (their caller refills them on the device with :func:`step_key_value`'s values)."""
    _STATE.step, _STATE.micro_step = int(step), int(micro_step)


@contextmanager
def quant_step(step: int, micro_step: int = 0) -> Iterator[None]:
    """Context manager form of :func:`set_quant_step` that restores the previous counters."""
    old = (_STATE.step, _STATE.micro_step)
    set_quant_step(step, micro_step)
    try:
        yield
    finally:
        set_quant_step(*old)


def state_dict() -> dict:
    return asdict(_STATE)


def load_state_dict(state: dict) -> None:
    for k, v in state.items():
        setattr(_STATE, k, int(v))
    _refresh_keys()


def generator(layer: int, role: str, device: torch.device | str) -> torch.Generator:
    """The generator for one GEMM of one layer in the current (step, micro-step, rank)."""
    seed = derive_seed(_STATE.seed, _STATE.step, _STATE.micro_step, layer, ROLES[role], _STATE.rank)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
