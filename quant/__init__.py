"""NVFP4 quantized linear layers: format, reference quantizers, schemes and one autograd Function.

See docs/spec.md (§1 format, §2 quantizers, §3 schemes) for the numerical contract.
"""

from .linear import QuantLinear, edge_block_patterns, quantize_model, quantized_linear, skip_patterns
from .randomness import quant_step, set_quant_rng, set_quant_step
from .schemes import ABLATIONS, LAYER_KEYS, SCHEMES, Gemm, Operand, Scheme, get_scheme, scheme_from_config

__all__ = [
    "ABLATIONS",
    "LAYER_KEYS",
    "QuantLinear",
    "SCHEMES",
    "Gemm",
    "Operand",
    "Scheme",
    "edge_block_patterns",
    "get_scheme",
    "quant_step",
    "quantize_model",
    "quantized_linear",
    "scheme_from_config",
    "set_quant_rng",
    "set_quant_step",
    "skip_patterns",
]
