"""The direct bias statistic of a stochastic estimator (SPEC §5, "Testing unbiasedness").

For an estimator ``X̂`` of a fixed tensor ``X`` (a quantized operand, or a layer's quantized
weight gradient against the exact one), each draw ``i`` gives the relative error along ``X``,

    p_i = ⟨X̂_i − X, X⟩ / ‖X‖²,

a scalar with ``E[p_i] = 0`` for an unbiased estimator. A shrinking estimator, ``E[X̂] = (1 − δ) X``,
has ``E[p_i] = −δ``. Over ``n`` independent draws, with ``p̄`` the mean and ``s`` the sample
standard deviation of the ``p_i``:

    shrinkage = −p̄,   se = s / √n,   z = p̄ / se,

and z is N(0, 1) for an unbiased estimator (central limit theorem: the ``p_i`` are i.i.d. with
finite variance). Projecting on ``X`` keeps the one direction a multiplicative bias lives in, so
the test sees a shrinkage of order ``se`` rather than waiting for a bias floor in ``‖mean − X‖²``.

**Threshold.** An estimator is flagged biased when ``|z| > Z_FLAG = 4``. Under the null,
``P(|z| > 4) = 6.3e-5``; a study reports at most about 50 (estimator, layer) pairs, so the chance
that any unbiased one is flagged is below 50 × 6.3e-5 = 0.32%. A shrinkage ``δ`` is flagged once
``n > (4 · s / δ)²`` draws: for MS-EDEN on SPEC §5's 256×1024 Gaussian (``s`` ≈ 8.4e-4 per draw),
``δ`` = 1e-4 needs about 1,100 draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Z_FLAG = 4.0


@dataclass(frozen=True)
class BiasStat:
    """The statistic of the module docstring over ``n`` draws."""

    n: int
    shrinkage: float  # −p̄: the relative shrinkage of E[X̂] along X (negative: X̂ is inflated)
    se: float  # standard error of p̄
    z: float  # p̄ / se

    @property
    def biased(self) -> bool:
        return abs(self.z) > Z_FLAG

    def describe(self) -> str:
        verdict = "biased" if self.biased else "no bias seen"
        return f"z {self.z:+.1f}, shrinkage {self.shrinkage:+.2e} ± {self.se:.1e} ({verdict}, n={self.n})"


class DirectionalBias:
    """Accumulates ``p_i`` (module docstring) over draws of an estimator of ``exact``."""

    def __init__(self, exact: torch.Tensor) -> None:
        self.exact = exact.double()
        self.norm2 = float(self.exact.square().sum())
        if self.norm2 == 0:
            raise ValueError("the exact tensor is zero: the relative error along it is undefined")
        self.n, self.total, self.total2 = 0, 0.0, 0.0

    def add(self, sample: torch.Tensor) -> None:
        p = float(((sample.double() - self.exact) * self.exact).sum()) / self.norm2
        self.n += 1
        self.total += p
        self.total2 += p * p

    def result(self) -> BiasStat:
        if self.n < 2:
            raise ValueError(f"the bias statistic needs at least 2 draws, got {self.n}")
        mean = self.total / self.n
        var = max(self.total2 - self.n * mean * mean, 0.0) / (self.n - 1)
        se = math.sqrt(var / self.n)
        z = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
        return BiasStat(self.n, -mean, se, z)


def estimator_bias(draw: Callable[[int], torch.Tensor], exact: torch.Tensor, n: int) -> BiasStat:
    """The statistic of ``draw(0), …, draw(n − 1)`` against ``exact``."""
    acc = DirectionalBias(exact)
    for i in range(n):
        acc.add(draw(i))
    return acc.result()
