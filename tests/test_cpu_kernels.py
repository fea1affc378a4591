"""The run's arithmetic and CPU kernels (training/cpu_kernels.py). That the pinned kernels give the
same run whatever oneDNN's kernels and the thread count is checked on the default run itself, in
tests/test_readme.py."""

from __future__ import annotations

import os

import pytest

from training import cpu_kernels
from training.errors import ConfigError


@pytest.mark.parametrize(("precision", "device", "expected"), [
    ("auto", "cpu", "fp32"), ("auto", "cuda", "bf16"), ("bf16", "cpu", "bf16"), ("fp32", "cuda", "fp32"),
])
def test_precision_auto_is_bf16_on_gpus_and_fp32_on_cpu(precision, device, expected):
    assert cpu_kernels.resolve_precision(precision, device) == expected


def test_an_unknown_precision_names_the_choices():
    with pytest.raises(ConfigError, match="must be auto, bf16 or fp32"):
        cpu_kernels.resolve_precision("fp16", "cpu")


def test_pin_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    cpu_kernels.pin()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx512"
    assert os.environ["MKL_CBWR"] == cpu_kernels.PINNED["MKL_CBWR"]


def test_the_cpu_kernels_line_says_when_they_are_not_the_portable_ones(monkeypatch):
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("MKL_CBWR", cpu_kernels.PINNED["MKL_CBWR"])
    assert "not the portable AVX2 kernels" in cpu_kernels.describe("cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_kernels.describe("cpu") == "CPU kernels: ATen AVX2, MKL branch AVX2,STRICT"
    assert cpu_kernels.describe("cuda") is None
