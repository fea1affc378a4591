"""Empty tensors (a dimension of size 0) through the reference quantizers and the quantized
linear layer: an empty result with tensor scale 1, as an all-zero tensor (docstring of
:mod:`quant.quantizers`), so a micro-batch of no tokens runs. The kernels' side is
tests/test_kernels.py's ``test_empty_operands``."""

from __future__ import annotations

import pytest
import torch

from quant import SCHEMES, get_scheme, quant_step, quantized_linear
from quant.hadamard import random_signs, rotate
from quant.quantizers import quantize_ms_eden, quantize_rtn, quantize_rtn_2d, quantize_sr

SIGNS = random_signs(128, torch.Generator().manual_seed(1), "cpu")

QUANTIZERS = {
    "rtn": lambda x: quantize_rtn(x),
    "rtn_4/6": lambda x: quantize_rtn(x, four_over_six=True),
    "rtn_16x16": lambda x: quantize_rtn_2d(x),
    "sr": lambda x: quantize_sr(x, torch.rand(x.shape)),
    "ms_eden": lambda x: quantize_ms_eden(rotate(x, SIGNS), torch.rand(x.shape[0], x.shape[1] // 16)),
    "ms_eden_posthoc": lambda x: quantize_ms_eden(rotate(x, SIGNS), torch.rand(x.shape[0], x.shape[1] // 16),
                                                  posthoc=True),
}


@pytest.mark.parametrize("shape", [(0, 256), (32, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_empty_tensor_quantizes_to_an_empty_result(name, shape):
    x = torch.randn(shape)
    q = QUANTIZERS[name](x)
    assert q.tensor_scale.item() == 1.0
    assert q.dequantize().shape == shape and q.pack().dequantize().shape == shape
    groups = (shape[0] // 16, shape[1] // 16) if name == "rtn_16x16" else (shape[0], shape[1] // 16)
    assert q.block_scale.shape == groups


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_linear_takes_no_tokens(name):
    """A micro-batch of no tokens: Y and dX are empty, dW is exactly zero (a sum over no
    tokens), as with ``F.linear``."""
    x = torch.randn(0, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    with quant_step(0):
        y = quantized_linear(x, w, get_scheme(name), 0)
        dx, dw = torch.autograd.grad(y, (x, w), torch.randn(0, 128))
    assert y.shape == (0, 128) and dx.shape == (0, 128)
    assert torch.equal(dw, torch.zeros(128, 128))
