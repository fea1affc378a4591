"""The benchmark scripts run end to end (on CPU, tiny shapes); their numbers are only meaningful on
a GPU (docs/performance.md), so only the output's structure is checked here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_tables_and_profile():
    r = subprocess.run(
        [sys.executable, "scripts/bench_step.py", "--model", "tiny", "--schemes", "bf16", "quartet2",
         "--steps", "1", "--warmup", "1", "--batch", "2", "--seq", "64", "--profile", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.count("profile of one step") == 2  # one per scheme
    rows = [line for line in out.splitlines() if line.startswith(("| bf16 |", "| quartet2 |"))]
    assert len(rows) == 4  # printed as measured, then again in the final table
    ratio = float(rows[-1].split("|")[-2])
    assert ratio > 0 and float(rows[-2].split("|")[-2]) == 1.0  # × first scheme: bf16 is the base


def test_bench_step_profiles_operands():
    """``--profile-ops`` names each kernel quantization of a step after its operand: six per
    quantized linear for quartet2 (X and W forward; E, Eᵀ, X̂ᵀ, Ŵᵀ backward), here the kernels
    run in the interpreter on CPU. It refuses to profile the compiling first step."""
    import os

    import yaml

    env = dict(os.environ, NVFP4_BACKEND="triton", TRITON_INTERPRET="1")
    cmd = [sys.executable, "scripts/bench_step.py", "--model", "tiny", "--schemes", "quartet2",
           "--steps", "1", "--batch", "2", "--seq", "64", "--profile-ops"]
    bad = subprocess.run(cmd + ["--warmup", "1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--warmup 2 or more" in bad.stderr
    r = subprocess.run(cmd + ["--warmup", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith(("| rtn", "| ms_eden"))]
    cfg = yaml.safe_load((ROOT / "configs" / "model" / "tiny.yaml").read_text())
    assert sum(int(c[1]) for c in rows) == 6 * 4 * cfg["n_layer"]
    names = [c[0].strip() for c in rows]
    tokens = 2 * 64
    assert f"rtn+4/6 rows {tokens}×{cfg['d_model']}" in names  # X of the qkv, o and gate_up projections
    assert any(n.startswith("ms_eden post hoc RHT128 packed cols") for n in names)  # X̂ᵀ
    assert all(float(c[2]) > 0 and float(c[4]) > 0 for c in rows)


def test_kernel_report_compiles_for_sm90_offline():
    import pytest
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel ships no ptxas")
    r = subprocess.run([sys.executable, "scripts/kernel_report.py", "--kernels", "rtn", "rht16_sr",
                        "--dims", "rows"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith(("| rtn |", "| rht16_sr |"))]
    assert len(rows) == 2
    for cells in rows:
        per_element, registers, spills = float(cells[4]), int(cells[5]), int(cells[6])
        assert 16 <= registers <= 255 and spills >= 0
        # A quantizer does at least a load, a conversion, a rounding and a store per element, and
        # these ran at 50-200 SASS instructions per element; counting per thread (16 elements)
        # instead of per element would exceed 500.
        assert 10 < per_element < 500, per_element


def test_kernel_report_compiles_the_explicit_draw_path_offline():
    """The kernels' explicit-uniform path (``RAND=0``: what the GPU tests run, with an FP32
    placeholder for the Philox key) builds for sm_90 without a GPU. (An early ``return`` in a
    constexpr branch once compiled Philox on that placeholder and failed only on the H200.)"""
    import pytest
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    r = subprocess.run([sys.executable, "scripts/kernel_report.py", "--kernels", "sr", "rht128_eden_posthoc",
                        "--dims", "rows", "--draws", "explicit"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sum(line.startswith(("| sr |", "| rht128_eden_posthoc |")) for line in r.stdout.splitlines()) == 2


def test_bench_train_runs_train_py_per_scheme(data_cache):
    """bench_train drives train.py itself: one run per scheme, whose logged tokens/s it reports
    with the ratio of step times to the first scheme (here bf16, on CPU, uncompiled)."""
    r = subprocess.run(
        [sys.executable, "scripts/bench_train.py", "--model", "tiny", "--schemes", "bf16", "quartet2",
         "--batch", "4", "--seq", "64", "--steps", "9", "--log-every", "3", "--skip", "1", "--no-compile",
         "--data-cache", str(data_cache), "--", "device=cpu", "precision=fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| tiny, 4×64")]
    assert [row[2].strip() for row in rows] == ["bf16", "quartet2"] * 2  # as measured, then the table
    assert float(rows[-2][5]) == 1.0 and float(rows[-1][5]) > 0
    assert all(float(row[3].replace(",", "")) > 0 for row in rows)
