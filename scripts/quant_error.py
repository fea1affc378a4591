"""Quantization-error table of SPEC §5, printed as markdown.

Protocol (SPEC §5):

* rotated rows: ``x = randn(rows, 128) · logspace(0, 8, rows, base=2)[:, None]``, a randomized
  Hadamard rotation with h = 128, E4M3 scales, groups of 16; RTN, SR and MS-EDEN.
* unrotated: a Gaussian ``n × n`` matrix; RTN 1×16, RTN 1×16 + 4/6, RTN 16×16.

``MSE`` is the mean over rows of ``‖x − x̂‖² / ‖x‖²`` (after undoing the rotation) and
``bits = −log2(MSE) / 2``. The paper's full sizes are ``rows = 2^20`` and ``n = 8192``;
``--small`` runs ``rows = 2^14`` and ``n = 1024`` in seconds (docs/quant_error.md compares both).

Usage: ``python scripts/quant_error.py [--rows 1048576] [--n 8192] [--seed 0]``
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant.hadamard import random_signs, rotate, unrotate  # noqa: E402
from quant.quantizers import (  # noqa: E402
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


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean over rows of ``‖x − x̂‖² / ‖x‖²`` (float64 accumulation)."""
    x, x_hat = x.double(), x_hat.double()
    return (((x - x_hat) ** 2).sum(1) / (x**2).sum(1)).mean().item()


def bits(mse: float) -> float:
    return -math.log2(mse) / 2


def rotated_errors(rows: int, seed: int = 0, h: int = 128) -> dict[str, float]:
    """RTN, SR and MS-EDEN (and MS-EDEN with post hoc range alignment) on the rotated,
    row-scaled Gaussian of SPEC §5."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=g) * torch.logspace(0, 8, rows, base=2)[:, None]
    signs = random_signs(h, g, "cpu")
    xr = rotate(x, signs)
    out = {"RTN": relative_mse(x, unrotate(quantize_rtn(xr).dequantize(), signs))}
    sr = quantize_sr(xr, torch.rand(xr.shape, generator=g)).dequantize()
    out["SR"] = relative_mse(x, unrotate(sr, signs))
    u = torch.rand(rows, 128 // 16, generator=g)
    out["MS-EDEN"] = relative_mse(x, unrotate(quantize_ms_eden(xr, u, chunk=h).dequantize(), signs))
    posthoc = quantize_ms_eden(xr, u, chunk=h, posthoc=True).dequantize()
    out["MS-EDEN (post hoc)"] = relative_mse(x, unrotate(posthoc, signs))
    return out


def unrotated_errors(n: int, seed: int = 0) -> dict[str, float]:
    """RTN 1×16, RTN 1×16 + 4/6 and RTN 16×16 on an ``n × n`` Gaussian, no rotation."""
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(n, n, generator=g)
    return {
        "RTN 1×16 (no rotation)": relative_mse(y, quantize_rtn(y).dequantize()),
        "RTN 1×16 + 4/6 (no rotation)": relative_mse(
            y, quantize_rtn(y, four_over_six=True).dequantize()
        ),
        "RTN 16×16 (no rotation)": relative_mse(y, quantize_rtn_2d(y).dequantize()),
    }


def error_table(rows: int, n: int, seed: int = 0) -> dict[str, float]:
    """All six rows of the SPEC §5 table at the given sizes."""
    return {**rotated_errors(rows, seed), **unrotated_errors(n, seed)}


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
    a = p.parse_args()
    rows, n = (2**14, 1024) if a.small else (a.rows, a.n)
    print(f"rows={rows} (×128, rotation h=128), n={n} (unrotated), seed={a.seed}\n")
    print(markdown(error_table(rows, n, a.seed)))


if __name__ == "__main__":
    main()
