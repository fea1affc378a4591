"""The CPU kernels a run uses, chosen so that a CPU run gives the same numbers on every x86-64
machine.

PyTorch picks its CPU kernels by the instruction sets of the machine it runs on, and kernels of
different vector widths sum in different orders:

- ATen's vectorized kernels (norms, softmax, reductions, AdamW) come in AVX2 and AVX-512 builds;
- MKL's FP32 GEMMs pick a code branch per processor (``MKL_CBWR`` fixes the branch);
- oneDNN's BF16 GEMMs (CPU autocast's matmuls and attention) pick AVX2, AVX-512 or AVX-512-BF16
  kernels, and oneDNN has no mode that fixes their order. CPU runs therefore train in FP32
  (``precision=auto``, :func:`resolve_precision`), which keeps oneDNN out of the step.

Measured on an AMD EPYC with AVX-512 BF16, 2 cores (torch 2.13.0+cpu, 2026-12-07), the default run
(tiny, quartet2) for 30 steps: under BF16 autocast its validation loss at step 30 was 5.5683,
5.5717, 5.5585 and 5.5761 with oneDNN's native, AVX-512 and AVX2 kernels and with ATen's AVX2
kernels; in FP32 with ATen's AVX2 kernels and MKL's AVX2 branch it was 5.5656 to the last bit
whatever oneDNN's kernels (native, AVX-512, AVX2), MKL's branch and the thread count (1, 2, 3).

:func:`pin` must run before torch is imported (``train.py`` calls it first thing); a variable
the user has set is left as it is.
"""

from __future__ import annotations

import os

from .errors import ConfigError

#: The environment that fixes the CPU kernels: ATen's AVX2 build and MKL's AVX2 branch, in MKL's
#: strict mode (the same result whatever the alignment of the data).
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}


def pin() -> None:
    """Select the portable CPU kernels (:data:`PINNED`) for this process and its children."""
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)


def resolve_precision(precision: str, device_type: str) -> str:
    """The arithmetic of a run: ``bf16`` (BF16 autocast, FP32 master weights) or ``fp32``.
    ``auto`` is BF16 on GPUs and FP32 on CPU (see the module docstring)."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"precision={precision} must be auto, bf16 or fp32. Fix: precision=auto "
                          f"(BF16 autocast on GPUs, FP32 on CPU).")
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return precision


def describe(device_type: str) -> str | None:
    """The run's line on its CPU kernels, or None on GPUs."""
    if device_type != "cpu":
        return None
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    line = f"CPU kernels: ATen {capability}, MKL branch {os.environ.get('MKL_CBWR', 'per processor')}"
    if capability != "AVX2" or os.environ.get("MKL_CBWR") != PINNED["MKL_CBWR"]:
        line += (" (not the portable AVX2 kernels that train.py selects: the numbers can differ from "
                 "another machine's; training/cpu_kernels.py)")
    return line
