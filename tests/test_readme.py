"""README's quick-start numbers come from the code, and are the same on every x86-64 machine.

The default run (``python train.py``: the tiny model, quartet2, the bundled corpus) runs as the
user runs it, as a ``train.py`` process, for its 300 steps. Its validation losses at steps 0, 100,
200 and 300 must read, to README's four decimals, what README.md says; so the text cannot go
stale silently. A second ``train.py`` process runs the same command with the kernels of another
machine, oneDNN limited to AVX2 and one thread, and must give the same numbers to the last bit
(training/cpu_kernels.py: on CPU a run trains in FP32 on ATen's AVX2 kernels and MKL's AVX2
branch). The 300 steps take about 4 minutes on 2 idle cores; their time grows with the load.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.preemption import STOP_FILE

REPO = Path(__file__).resolve().parents[1]
SENTENCE = re.compile(r"validation loss falls from ([\d.]+) at step 0 to ([\d.]+), ([\d.]+) and ([\d.]+) at\s+steps"
                      r"\s+100, 200 and 300")

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="README's numbers are those of x86-64 CPUs (ATen's AVX2 kernels); this CPU runs others")


def readme_losses() -> list[str]:
    found = SENTENCE.search(" ".join((REPO / "README.md").read_text().split()))
    assert found, "README.md lost its quick-start sentence on the validation losses"
    return list(found.groups())


def _train(run_dir: Path, data_cache: Path, env: dict[str, str] | None = None,
           stop_after_rows: int | None = None) -> list[dict]:
    """``python train.py`` with the default config (W&B off, CPU), in ``run_dir``; its metrics
    rows. ``stop_after_rows``: request a stop (the stop file) once that many rows exist."""
    command = [sys.executable, str(REPO / "train.py"), f"data.cache_dir={data_cache}", f"run_dir={run_dir}",
               "wandb.enabled=false", "device=cpu"]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    while stop_after_rows is not None and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= stop_after_rows:
            (run_dir / STOP_FILE).touch()
            break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=3600)
    assert proc.returncode == 0, out[-3000:]  # finished, or checkpointed on the stop request
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _numbers(row: dict) -> dict:
    """A metrics row without its timings (``perf/``)."""
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


@pytest.fixture(scope="module")
def default_run(data_cache, tmp_path_factory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("readme") / "run", data_cache)


def test_readme_quick_start_losses(default_run):
    quoted = readme_losses()
    val = {r["step"]: r["val/loss"] for r in default_run if "val/loss" in r}
    measured = [f"{val[step]:.4f}" for step in (0, 100, 200, 300)]
    assert measured == quoted, f"README.md says {quoted}, the default run gives {measured}: update README.md"


def test_another_cpus_kernels_give_the_same_run(default_run, data_cache, tmp_path):
    """oneDNN's kernels (AVX2 here, AVX-512 or AVX-512-BF16 natively) and the thread count are
    what differ between x86-64 machines once train.py has fixed ATen's and MKL's."""
    other = _train(tmp_path / "run", data_cache, env={"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"},
                   stop_after_rows=25)
    by_step = {r["step"]: _numbers(r) for r in default_run}
    assert len(other) >= 25
    assert [by_step[r["step"]] for r in other] == [_numbers(r) for r in other]
