"""The randomized Hadamard transform (SPEC §2, MS-EDEN step 1).

``rotate(x, σ) = (x ⊙ σ) · H_h / √h`` on each chunk of ``h`` consecutive elements of the last
dimension, with one sign vector ``σ ∈ {±1}^h`` shared by all chunks (and by both operands of a
GEMM, so the rotations cancel in the product: ``(A D H)(B D H)ᵀ = A D H Hᵀ D Bᵀ = A Bᵀ``).
The signs act on the input side; after the Hadamard they would cancel under sign-symmetric
rounding and bias the estimator (SPEC §2).
"""

from __future__ import annotations

import functools
import math

import torch

ROTATION_SIZES = (16, 32, 64, 128)


def check_rotation_size(h: int) -> None:
    if h not in ROTATION_SIZES:
        raise ValueError(
            f"rotation size {h} is not supported; choose one of {ROTATION_SIZES} (SPEC §2)."
        )


@functools.cache
def _sylvester(h: int) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]."""
    H = torch.ones(1, 1)
    while H.shape[0] < h:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return H


def hadamard_matrix(h: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised (orthogonal, symmetric) Sylvester Hadamard matrix ``H_h / √h`` in float32."""
    check_rotation_size(h)
    return (_sylvester(h) / math.sqrt(h)).to(device)


def random_signs(h: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Uniform random signs ``σ ∈ {±1}^h`` (float32) drawn from ``generator``."""
    bits = torch.randint(0, 2, (h,), generator=generator, device=device)
    return (bits * 2 - 1).float()


def check_rotatable(n: int, h: int, what: str = "dimension") -> None:
    if n % h != 0:
        raise ValueError(
            f"{what} has size {n}, which is not divisible by the rotation size {h}: the "
            f"Hadamard rotation works on chunks of {h} elements. Use a size divisible by {h} "
            f"or a smaller rotation (quant.rotation=...)."
        )


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x · H_h / √h`` on the last dim (size h) by the fast Walsh–Hadamard butterfly, in float32.

    Stage ``s`` (span ``m = 2^s``) replaces each pair ``(a, b) = (x[j], x[j+m])`` by
    ``(a + b, a − b)``; the log2(h) stages give ``x · H_h`` in Sylvester order, then one multiply
    by the float32 constant ``1/√h``. Every operation is fixed, so a kernel that performs the same
    butterfly reproduces it bit for bit (a matrix product's summation order is not specified).
    """
    h = x.shape[-1]
    y = x.float()
    spare = None  # the buffer of the stage before last, reused (never the input)
    m = 1
    while m < h:
        out = torch.empty(y.shape, dtype=torch.float32, device=y.device) if spare is None else spare
        pairs = y.reshape(*y.shape[:-1], h // (2 * m), 2, m)
        sums = out.view(pairs.shape)
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=sums[..., 0, :])
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=sums[..., 1, :])
        spare = y if m > 1 else None
        y = out
        m *= 2
    return y * torch.tensor(1.0 / math.sqrt(h), dtype=torch.float32)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``(x ⊙ σ) · H_h / √h`` on chunks of ``h = len(signs)`` along the last dim (float32)."""
    h = signs.numel()
    check_rotation_size(h)
    check_rotatable(x.shape[-1], h, "the rotated (last) dimension")
    chunks = x.float().reshape(*x.shape[:-1], x.shape[-1] // h, h) * signs
    return fwht(chunks).reshape(x.shape)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``(y · H_h / √h) ⊙ σ`` (the normalised H is its own inverse)."""
    h = signs.numel()
    chunks = fwht(y.float().reshape(*y.shape[:-1], y.shape[-1] // h, h))
    return (chunks * signs).reshape(y.shape)
