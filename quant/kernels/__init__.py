"""Fused Triton kernels of the NVFP4 quantizers (SPEC §2), bit-exact with :mod:`quant.quantizers`.

Importing this package imports triton and registers the ``nvfp4::`` custom ops. Under
``TRITON_INTERPRET=1`` (set before the import) the kernels run on CPU tensors, with the
interpreter's fp8/bf16 conversion bugs patched (:mod:`quant.kernels.interpreter`).

Public API (all ops take a 2-D ``x``; ``transpose=True`` quantizes ``xᵀ``, i.e. along columns):
``rtn``, ``rtn_2d``, ``sr``, ``rht_ms_eden``, ``rht_sr``, ``rht_rtn``, the generic
``quantize_operand``, ``amax``, ``unpack``, ``philox_uniforms``, ``philox_signs``, and the GEMM
epilogue ``scale_product`` (a plain function: compiled graphs leave the epilogue to inductor).
Launch tuning (tiles, warps, column paths; never the results): :class:`KernelTuning`,
:func:`set_tuning`, :func:`use_tuning`, :func:`get_tuning`, :func:`tuning_from_mapping`
(:mod:`.tuning`). :mod:`.dispatch` connects the ops to
:class:`quant.linear.QuantizedLinearFunction`.
"""

from .ops import (  # noqa: F401
    amax,
    philox_signs,
    philox_uniforms,
    quantize_operand,
    rht_ms_eden,
    rht_rtn,
    rht_sr,
    rtn,
    rtn_2d,
    scale_product,
    sr,
    unpack,
)
from .tuning import (  # noqa: F401
    KernelTuning,
    get_tuning,
    set_tuning,
    tuning_from_mapping,
    use_tuning,
)
