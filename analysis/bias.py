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

**Other directions.** Projecting on ``X`` sees only a bias along ``X``; an estimator can be exact
along ``X`` by construction (MS-EDEN's energy-weighted correction makes ``⟨X̂, X⟩ = ‖X‖²`` in
every draw) and biased elsewhere. :class:`RandomDirectionsBias` projects the error on ``k``
random directions ``d_1 … d_k`` (i.i.d. Gaussian tensors of the shape of ``X``, fixed by a
seed, independent of the estimator), ``p_ij = ⟨X̂_i − X, d_j⟩ / (‖X‖ ‖d_j‖)``, and tests
``E[p_i] = 0`` with Hotelling's

    T² = n · p̄ᵀ S⁻¹ p̄      (S the k×k sample covariance of the p_i),

which whitens the projections: they are correlated whenever the error's covariance is not
isotropic (a heavy-tailed X puts most of it on a few coordinates), so a plain ``Σ z_j²`` would
not be χ²_k. Under no bias, ``T² (n − k) / (k (n − 1))`` is F(k, n − k) for Gaussian ``p_i``
(each is a sum over the whole tensor, so close to Gaussian by the central limit theorem), and
χ²_k as n → ∞. :func:`hotelling_p_value` gives its upper tail in closed form (k even). An
estimator is flagged when that p-value is below ``P_FLAG = P(|N(0, 1)| > 4) = 6.3e-5``, the
false-flag rate of ``|z| > 4``, so the bound of 0.32% for 50 estimators holds for both tests
together if each counts as one. A bias ``b = E[X̂] − X`` gives ``E[p_ij] = ⟨b, d_j⟩ / (‖X‖ ‖d_j‖)``;
the expected T² grows as ``k + n λ``, with λ the squared bias in the whitened projections, so
a bias is found once ``n λ`` passes the threshold (k = 8: T² = 35.3 at n = 300, 33.6 at
n = 1000, 32.9 as n → ∞).

How large the bias is, in all directions at once: with ``ē`` the mean error over the draws,
``bias² = (‖ē‖² − tr Σ̂ / n) / ‖X‖²`` (Σ̂ the elements' sample covariance, so ``tr Σ̂ / n`` is
the part of ``‖ē‖²`` the noise contributes) is an unbiased estimate of ``‖E[X̂] − X‖² / ‖X‖²``;
``mse`` is a single draw's ``E‖X̂ − X‖² / ‖X‖²``, the scale to read it against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Z_FLAG = 4.0
P_FLAG = math.erfc(Z_FLAG / math.sqrt(2.0))
"""The two-sided tail of ``|z| > Z_FLAG`` (6.3e-5): the p-value below which T² flags a bias."""
DIRECTIONS = 8
"""Random directions of :class:`RandomDirectionsBias` by default."""


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




def hotelling_p_value(t2: float, n: int, k: int) -> float:
    """``P(T² > t2)`` for Hotelling's T² of ``n`` draws of a ``k``-vector with mean 0 (even k,
    ``n > k``): ``t2 (n − k) / (k (n − 1))`` is F(k, m), m = n − k, whose upper tail at f is the
    regularised incomplete beta ``I_y(m/2, k/2)``, ``y = m / (m + k f)``; for an integer second
    argument b = k/2 that is the finite sum ``y^a Σ_{j<b} Γ(a + j) / (Γ(a) j!) · (1 − y)^j``
    with a = m/2 (as m → ∞, χ²_k's tail ``e^(−t2/2) Σ_{j<k/2} (t2/2)^j / j!``)."""
    if k % 2 or n <= k:
        raise ValueError(f"hotelling_p_value needs an even k and n > k, got k={k}, n={n}")
    if t2 <= 0:
        return 1.0
    m = n - k
    f = t2 * m / (k * (n - 1))
    a = m / 2.0
    log_y = math.log(m) - math.log(m + k * f)
    log_1y = math.log(k * f) - math.log(m + k * f)
    terms = (a * log_y + math.lgamma(a + j) - math.lgamma(a) - math.lgamma(j + 1.0) + j * log_1y
             for j in range(k // 2))
    return min(1.0, sum(math.exp(t) for t in terms))


@dataclass(frozen=True)
class DirectionsStat:
    """The random-directions statistic of the module docstring over ``n`` draws."""

    n: int
    k: int  # random directions
    t2: float  # Hotelling's T² of the k projections
    p_value: float  # P(T² ≥ t2) under no bias
    bias2: float  # estimate of ‖E[X̂] − X‖² / ‖X‖² (noisy around 0 when unbiased)
    mse: float  # a single draw's mean ‖X̂ − X‖² / ‖X‖²

    @property
    def biased(self) -> bool:
        return self.p_value < P_FLAG

    def describe(self) -> str:
        verdict = "biased" if self.biased else "no bias seen"
        return (f"T² {self.t2:.1f} over {self.k} random directions (p {self.p_value:.1e}), bias² "
                f"{self.bias2:+.1e} against an MSE of {self.mse:.1e} ({verdict}, n={self.n})")


class RandomDirectionsBias:
    """Accumulates the projections of ``X̂_i − X`` on ``k`` random directions (module docstring),
    and the sums that ``bias²`` and ``mse`` need, over draws of an estimator of ``exact``."""

    def __init__(self, exact: torch.Tensor, k: int = DIRECTIONS, seed: int = 0) -> None:
        self.exact = exact.double()
        self.norm2 = float(self.exact.square().sum())
        if self.norm2 == 0:
            raise ValueError("the exact tensor is zero: the relative error is undefined")
        d = torch.randn((k, self.exact.numel()), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64)
        self.directions = (d / d.norm(dim=1, keepdim=True)).to(self.exact.device)
        self.k = k
        self.projections: list[torch.Tensor] = []
        self.error_sum = torch.zeros_like(self.exact).flatten()
        self.square_sum = 0.0

    def add(self, sample: torch.Tensor) -> None:
        err = (sample.double() - self.exact).flatten()
        self.projections.append(self.directions @ err / math.sqrt(self.norm2))
        self.error_sum += err
        self.square_sum += float(err.square().sum())

    def result(self) -> DirectionsStat:
        n = len(self.projections)
        if n <= self.k:
            raise ValueError(f"T² over {self.k} directions needs more than {self.k} draws, got {n}")
        p = torch.stack(self.projections).cpu()
        mean = p.mean(0)
        t2 = float(n * mean @ torch.linalg.solve(torch.cov(p.T), mean))
        mean_err2 = float((self.error_sum / n).square().sum())
        noise = (self.square_sum - n * mean_err2) / (n - 1) / n
        return DirectionsStat(n, self.k, t2, hotelling_p_value(t2, n, self.k),
                              (mean_err2 - noise) / self.norm2, self.square_sum / n / self.norm2)


@dataclass(frozen=True)
class EstimatorBias:
    """Both statistics of one estimator: along the exact tensor and on random directions
    (``None`` with no directions asked for, or too few draws for them)."""

    along: BiasStat
    directions: DirectionsStat | None

    @property
    def biased(self) -> bool:
        return self.along.biased or (self.directions is not None and self.directions.biased)


def estimator_bias(draw: Callable[[int], torch.Tensor], exact: torch.Tensor, n: int,
                   directions: int = DIRECTIONS, seed: int = 0) -> EstimatorBias:
    """Both statistics of ``draw(0), …, draw(n − 1)`` against ``exact``; the random directions
    come from ``seed``, and are left out when ``directions`` is 0 or ``n ≤ directions``."""
    along = DirectionalBias(exact)
    spread = RandomDirectionsBias(exact, directions, seed) if 0 < directions < n else None
    for i in range(n):
        sample = draw(i)
        along.add(sample)
        if spread is not None:
            spread.add(sample)
    return EstimatorBias(along.result(), None if spread is None else spread.result())
