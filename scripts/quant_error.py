"""Quantization-error table of SPEC §5, printed as markdown.

Protocol (SPEC §5):

* rotated rows: ``x = randn(rows, 128) · logspace(0, 8, rows, base=2)[:, None]``, a randomized
  Hadamard rotation with h = 128, E4M3 scales, groups of 16; RTN, SR and MS-EDEN.
* unrotated: a Gaussian ``n × n`` matrix; RTN 1×16, RTN 1×16 + 4/6, RTN 16×16.

``MSE`` is the mean over rows of ``‖x − x̂‖² / ‖x‖²`` (after undoing the rotation) and
``bits = −log2(MSE) / 2``. The paper's full sizes are ``rows = 2^20`` and ``n = 8192``;
``--small`` runs ``rows = 2^14`` and ``n = 1024`` in seconds (docs/quant_error.md compares both).

The quantizers run on chunks of rows with the whole tensor's amax, and the per-row errors are
averaged once at the end, so the numbers do not depend on the chunk size (see
:func:`rotated_errors`); the chunks bound the memory.

Usage: ``python scripts/quant_error.py [--rows 1048576] [--n 8192] [--seed 0] [--chunk-elements N]
[--threads 1]``
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from quant.format import GROUP
from quant.hadamard import random_signs, rotate, unrotate
from quant.quantizers import (
    quantize_ms_eden,
    quantize_rtn,
    quantize_rtn_2d,
    quantize_sr,
)

PAPER = {
    "RTN": 9.0e-3,
    "SR": 23.5e-3,
    "MS-EDEN": 9.8e-3,
    "RTN 1×16 (no rotation)": 9.0e-3,
    "RTN 1×16 + 4/6 (no rotation)": 7.6e-3,
    "RTN 16×16 (no rotation)": 12.4e-3,
}
"""SPEC §5 reference MSEs."""

BOUND_BY = {"MS-EDEN (post hoc)": "MS-EDEN"}
"""Rows without a paper number, and the paper row they must not exceed (SPEC §2: post hoc range
alignment keeps the error no worse than the table)."""


CHUNK_ELEMENTS = 2**20
"""Elements per chunk of rows (4 MiB per float32 intermediate). The full-size run's memory is
then mostly its random draws (x and SR's uniforms, 512 MiB each); quantizing the whole tensors
at once would hold about 12 GB of intermediates."""

E4M3_MIN_NORMAL = 2.0**-6
"""E4M3's smallest normal value; below it the E4M3 grid no longer scales with powers of two."""


def row_chunks(rows: int, cols: int, chunk_elements: int = CHUNK_ELEMENTS) -> list[slice]:
    """Consecutive slices of rows holding about ``chunk_elements`` elements each; their length is
    a multiple of 16 (at least 16), so no 16×16 tile straddles two chunks."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements}: give a positive number of elements")
    step = max(GROUP, chunk_elements // cols // GROUP * GROUP)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def row_errors(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """``‖x − x̂‖² / ‖x‖²`` of each row (float64 accumulation)."""
    x, x_hat = x.double(), x_hat.double()
    return ((x - x_hat) ** 2).sum(1) / (x**2).sum(1)


def bits(mse: float) -> float:
    """``−log2(MSE) / 2`` (SPEC §5)."""
    return -math.log2(mse) / 2


def check_posthoc_chunks(tensor_scales: list[torch.Tensor], smallest_scales: list[torch.Tensor]) -> None:
    """Raise ValueError unless post hoc MS-EDEN on chunks of rows gave the whole tensor's ``x̂``.

    Post hoc range alignment (``quantize_ms_eden(posthoc=True)``) is row-local except for its
    tensor scale, the smallest power of two ``s`` with ``max(c) / s ≤ 448`` over the tensor.
    Chunk ``k`` alone gets ``s_k`` (its ``tensor_scales`` entry), and the whole tensor
    ``s = max_k s_k = 2^j · s_k`` (the rule is monotone in ``max(c)``). When every corrected
    scale has ``c / s ≥ 2^-6`` (E4M3's smallest normal), the E4M3 neighbours of ``c / s`` are
    those of ``c / s_k`` divided by ``2^j`` and ``P(up)`` is the same, so with the same uniform
    ``sr(c / s) = sr(c / s_k) / 2^j`` and ``x̂ = q · sr(c / s) · s`` is the chunk's ``x̂`` bit for
    bit (products with powers of two are exact). A chunk's ``smallest_scales`` entry is the
    smallest nonzero ``r · s_k``, ``r = sr(c / s_k)``: ``r > 2^(j-6)`` bounds the lower
    neighbour of ``c / s_k`` (hence ``c / s_k`` itself) by ``2^(j-6)`` from below, which is the
    condition. Chunks with ``s_k = s`` need none.
    """
    s = torch.stack(tensor_scales).amax()
    for k, (s_k, smallest) in enumerate(zip(tensor_scales, smallest_scales)):
        if s_k < s and not smallest > E4M3_MIN_NORMAL * s:
            raise ValueError(
                f"chunk {k} of the post hoc MS-EDEN row has a block scale of {float(smallest):.3g} "
                f"· s_t against the tensor's s_t of {float(s):.3g}: below E4M3's normal range, "
                f"where chunked and whole-tensor quantization differ. Fix: pass a larger "
                f"--chunk-elements (rows × 128 quantizes the whole tensor at once)."
            )


def rotated_errors(
    rows: int, seed: int = 0, h: int = 128, chunk_elements: int = CHUNK_ELEMENTS
) -> dict[str, float]:
    """RTN, SR and MS-EDEN (and MS-EDEN with post hoc range alignment) on the rotated,
    row-scaled Gaussian of SPEC §5: the mean over rows of ``‖x − x̂‖² / ‖x‖²``.

    The random draws are made whole and in this order: ``x``, the signs, SR's uniforms,
    MS-EDEN's uniforms. The quantizers then run on chunks of rows (:func:`row_chunks`), each
    given the amax of the whole rotated tensor (the largest of the chunks' amaxes), which makes
    RTN, SR and MS-EDEN row-local; the per-row errors are collected into one float64 vector and
    averaged at the end. Every row is then the number a single whole-tensor pass gives, bit for
    bit, whatever ``chunk_elements``; the post hoc row is checked by
    :func:`check_posthoc_chunks`.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=g).mul_(torch.logspace(0, 8, rows, base=2)[:, None])
    signs = random_signs(h, g, "cpu")
    u_sr = torch.rand(x.shape, generator=g)
    u_eden = torch.rand(rows, 128 // GROUP, generator=g)
    chunks = row_chunks(rows, 128, chunk_elements)
    amax = torch.stack([rotate(x[c], signs).abs().amax() for c in chunks]).amax()
    names = ("RTN", "SR", "MS-EDEN", "MS-EDEN (post hoc)")
    err = {name: torch.empty(rows, dtype=torch.float64) for name in names}
    posthoc_scales, posthoc_smallest = [], []
    for c in chunks:
        xc = x[c]
        xr = rotate(xc, signs)
        err["RTN"][c] = row_errors(xc, unrotate(quantize_rtn(xr, amax=amax).dequantize(), signs))
        sr = quantize_sr(xr, u_sr[c], amax=amax).dequantize()
        err["SR"][c] = row_errors(xc, unrotate(sr, signs))
        eden = quantize_ms_eden(xr, u_eden[c], chunk=h, amax=amax).dequantize()
        err["MS-EDEN"][c] = row_errors(xc, unrotate(eden, signs))
        posthoc = quantize_ms_eden(xr, u_eden[c], chunk=h, posthoc=True)
        scales = posthoc.block_scale * posthoc.tensor_scale
        posthoc_scales.append(posthoc.tensor_scale)
        posthoc_smallest.append(torch.where(scales > 0, scales, math.inf).amin())
        err["MS-EDEN (post hoc)"][c] = row_errors(xc, unrotate(posthoc.dequantize(), signs))
    check_posthoc_chunks(posthoc_scales, posthoc_smallest)
    return {name: e.mean().item() for name, e in err.items()}


def unrotated_errors(n: int, seed: int = 0, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, float]:
    """RTN 1×16, RTN 1×16 + 4/6 and RTN 16×16 on an ``n × n`` Gaussian, no rotation: the mean
    over rows of ``‖y − ŷ‖² / ‖y‖²``, computed on chunks of rows given the whole tensor's amax
    (as in :func:`rotated_errors`; chunks of a multiple of 16 rows keep the 16×16 tiles whole)."""
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(n, n, generator=g)
    chunks = row_chunks(n, n, chunk_elements)
    amax = torch.stack([y[c].abs().amax() for c in chunks]).amax()
    quantizers = {
        "RTN 1×16 (no rotation)": lambda v: quantize_rtn(v, amax=amax),
        "RTN 1×16 + 4/6 (no rotation)": lambda v: quantize_rtn(v, four_over_six=True, amax=amax),
        "RTN 16×16 (no rotation)": lambda v: quantize_rtn_2d(v, amax=amax),
    }
    err = {name: torch.empty(n, dtype=torch.float64) for name in quantizers}
    for c in chunks:
        for name, quantize in quantizers.items():
            err[name][c] = row_errors(y[c], quantize(y[c]).dequantize())
    return {name: e.mean().item() for name, e in err.items()}


def error_table(rows: int, n: int, seed: int = 0, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, float]:
    """All seven rows of the SPEC §5 table at the given sizes (see :func:`rotated_errors`)."""
    return {**rotated_errors(rows, seed, chunk_elements=chunk_elements),
            **unrotated_errors(n, seed, chunk_elements)}


def markdown(table: dict[str, float]) -> str:
    lines = [
        "| rounding | MSE | bits | paper MSE | paper bits | relative difference |",
        "|---|---|---|---|---|---|",
    ]
    for name, mse in table.items():
        ref = PAPER[BOUND_BY.get(name, name)]
        lines.append(
            f"| {name} | {mse * 1e3:.2f}e-3 | {bits(mse):.3f} | {ref * 1e3:.1f}e-3 | "
            f"{bits(ref):.3f} | {(mse - ref) / ref:+.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2**20, help="rows of the rotated test (paper: 2^20)")
    p.add_argument("--n", type=int, default=8192, help="side of the unrotated Gaussian (paper: 8192)")
    p.add_argument("--small", action="store_true", help="rows=2^14, n=1024: seconds on a laptop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-elements", type=int, default=CHUNK_ELEMENTS,
                   help="elements per chunk of rows (memory, not results: any value gives the same "
                        f"numbers; default {CHUNK_ELEMENTS})")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: with other jobs on a 2-core machine, two threads "
                        "ran the full-size table several times slower; docs/quant_error.md)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows, n = (2**14, 1024) if a.small else (a.rows, a.n)
    print(f"rows={rows} (×128, rotation h=128), n={n} (unrotated), seed={a.seed}\n")
    try:
        table = error_table(rows, n, a.seed, a.chunk_elements)
    except ValueError as err:
        sys.exit(f"error: {err}")
    print(markdown(table))


if __name__ == "__main__":
    main()
