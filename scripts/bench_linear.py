"""Forward + backward of one quantized linear layer per scheme against BF16 ``nn.Linear``.

    python scripts/bench_linear.py                       # 100m and 1.9b projection shapes
    python scripts/bench_linear.py --models 1.9b --schemes bf16 quartet2

For each block projection of a preset (fused QKV, attention output, fused up+gate, down) at
16384 tokens: BF16 autocast, BF16 activations, FP32 master weight (as in training), time of
``y = layer(x); y.backward(dy)`` (median of CUDA-event timings). The ``bf16`` row is a plain
``nn.Linear``; the others are ``QuantLinear`` on the kernel backend (quant.backend ``auto``).
Prints per-shape times, the per-preset sum and its ratio to BF16. Without the project installed
(a bare GPU box), run it from the repository root as ``python -m scripts.bench_linear``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import quant
from quant.linear import QuantLinear

PRESETS = {  # d_model, mlp_hidden: (in, out) of qkv, proj, up_gate, down
    "100m": (1024, 2816),
    "1.9b": (2048, 5632),
}


def shapes(model: str) -> list[tuple[str, int, int]]:
    d, h = PRESETS[model]
    return [("qkv", d, 3 * d), ("proj", d, d), ("up_gate", d, 2 * h), ("down", h, d)]


def time_layer(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int, warmup: int) -> float:
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)

    for i in range(warmup):
        quant.set_quant_step(i)
        step()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        quant.set_quant_step(100 + i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["100m", "1.9b"])
    p.add_argument("--schemes", nargs="+", default=["bf16", "quartet2", "nvidia", "four_over_six", "tetrajet_v2"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    dev = torch.device("cuda")
    import triton

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{a.tokens} tokens, backend={quant.backend.get_backend()}, draws={quant.backend.get_draws()}\n")
    rows = ["| preset | layer | in→out | " + " | ".join(f"{s} (ms)" for s in a.schemes) + " |",
            "|---|---|---|" + "---|" * len(a.schemes)]
    summary = []
    for model in a.models:
        totals = {s: 0.0 for s in a.schemes}
        for name, fin, fout in shapes(model):
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(a.tokens, fin, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            dy = torch.randn(a.tokens, fout, device=dev, dtype=torch.bfloat16, generator=g)
            cells = []
            for scheme in a.schemes:
                if scheme == "bf16":
                    layer = nn.Linear(fin, fout, bias=False, device=dev)
                else:
                    layer = QuantLinear(fin, fout, scheme=quant.get_scheme(scheme), name=name, device=dev)
                try:
                    ms = time_layer(layer, x, dy, a.iters, a.warmup)
                except Exception as e:  # report and go on
                    print(f"{model} {name} {scheme} failed: {type(e).__name__}: {e}", flush=True)
                    ms = float("nan")
                totals[scheme] += ms
                cells.append(f"{ms:.3f}")
                del layer
                x.grad = None
            rows.append(f"| {model} | {name} | {fin}→{fout} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
        base = totals.get("bf16")
        rows.append(f"| {model} | **sum** | | " + " | ".join(
            f"{totals[s]:.3f}" + (f" ({totals[s] / base:.2f}×)" if base else "") for s in a.schemes) + " |")
        print(rows[-1], flush=True)
        summary.append((model, totals))
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
