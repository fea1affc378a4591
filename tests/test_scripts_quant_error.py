"""scripts/quant_error.py computes SPEC §5's error table on chunks of rows: chunked, it must give
the numbers of one whole-tensor pass exactly (the per-row errors are collected and averaged once).
About 2 s on 2 cores."""

from __future__ import annotations

import math

import pytest
import torch

from quant.hadamard import random_signs, rotate, unrotate
from quant.quantizers import quantize_ms_eden, quantize_rtn, quantize_rtn_2d, quantize_sr
from scripts.quant_error import check_posthoc_chunks, error_table, row_chunks

ROWS, N = 2**11, 256


def whole_tensor_table(rows: int, n: int, seed: int = 0) -> dict[str, float]:
    """SPEC §5's protocol in one pass over whole tensors, each quantizer finding its own amax."""
    def mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
        x, x_hat = x.double(), x_hat.double()
        return (((x - x_hat) ** 2).sum(1) / (x**2).sum(1)).mean().item()

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=g) * torch.logspace(0, 8, rows, base=2)[:, None]
    signs = random_signs(128, g, "cpu")
    xr = rotate(x, signs)
    u = torch.rand(xr.shape, generator=g)
    ue = torch.rand(rows, 8, generator=g)
    y = torch.randn(n, n, generator=torch.Generator().manual_seed(seed + 1))
    return {
        "RTN": mse(x, unrotate(quantize_rtn(xr).dequantize(), signs)),
        "SR": mse(x, unrotate(quantize_sr(xr, u).dequantize(), signs)),
        "MS-EDEN": mse(x, unrotate(quantize_ms_eden(xr, ue).dequantize(), signs)),
        "MS-EDEN (post hoc)": mse(x, unrotate(quantize_ms_eden(xr, ue, posthoc=True).dequantize(), signs)),
        "RTN 1×16 (no rotation)": mse(y, quantize_rtn(y).dequantize()),
        "RTN 1×16 + 4/6 (no rotation)": mse(y, quantize_rtn(y, four_over_six=True).dequantize()),
        "RTN 16×16 (no rotation)": mse(y, quantize_rtn_2d(y).dequantize()),
    }


def test_chunked_table_equals_the_whole_tensor_pass_exactly() -> None:
    # 2^14 elements per chunk: 16 chunks of 128 rotated rows, 4 chunks of 64 unrotated rows
    # (the first rotated chunks, with the smallest rows, get smaller post hoc tensor scales).
    assert len(row_chunks(ROWS, 128, 2**14)) == 16 and len(row_chunks(N, N, 2**14)) == 4
    assert error_table(ROWS, N, chunk_elements=2**14) == whole_tensor_table(ROWS, N)


def test_row_chunks_cover_the_rows_in_whole_tiles() -> None:
    chunks = row_chunks(1000, 128, 5000)  # 5000 // 128 = 39 rows → 32, a multiple of 16
    assert [c.start for c in chunks] == list(range(0, 1000, 32)) and chunks[-1].stop == 1000
    assert row_chunks(40, 4096, 1) == [slice(0, 16), slice(16, 32), slice(32, 40)]
    with pytest.raises(ValueError, match="positive number of elements"):
        row_chunks(16, 16, 0)


def test_posthoc_chunks_below_e4m3s_normal_range_are_refused() -> None:
    one, quarter = torch.tensor(1.0), torch.tensor(0.25)
    # chunk 1's scale is 4× smaller: its smallest block scale must stay above 2^-6 · 1
    check_posthoc_chunks([one, quarter], [torch.tensor(0.5), torch.tensor(2.0**-5)])
    check_posthoc_chunks([one, one], [torch.tensor(2.0**-9), torch.tensor(2.0**-9)])  # no rescaling
    check_posthoc_chunks([one, quarter], [torch.tensor(0.5), torch.tensor(math.inf)])  # all-zero chunk
    with pytest.raises(ValueError, match="chunk 1 .* Fix: pass a larger --chunk-elements"):
        check_posthoc_chunks([one, quarter], [torch.tensor(0.5), torch.tensor(2.0**-6)])
