"""Check the native NVFP4 backend (quant.native) on this machine, for every quantized scheme and
each of its three GEMMs (a QuantLinear's forward, dgrad and wgrad under BF16 autocast):

* ``native``: torch's NVFP4 ``scaled_mm`` on the FP4 tensor cores (Blackwell only);
* ``simulated``: the same packed operands through the simulator of the documented semantics
  (:mod:`quant.native.scaled_mm_sim`);
* ``emulated``: the emulated GEMM of the Triton backend (the reference on CPU).

    python -m scripts.check_native               # on a Blackwell GPU: all three
    python -m scripts.check_native --simulate    # anywhere: simulated against emulated

Each pair should agree up to FP32 accumulation order: after the one rounding to BF16, equal
except for outputs whose two sums fall on either side of a rounding boundary, which differ by
one ulp. Prints a markdown table (largest difference in BF16 ulps of the output, share of
outputs that differ); exits 1 when a pair differs by more than ``--max-ulps`` anywhere or a
result is not finite, 2 when native GEMMs cannot run here and ``--simulate`` was not given.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from quant import backend, get_scheme, native, quant_step, quantized_linear

SCHEMES = ("nvidia", "four_over_six", "tetrajet_v2", "quartet2")
# (tokens, in-features, out-features): one shape whose reductions need padding to 64 and rows
# padding to 128 (quartet2's 128-rotations fix its T and N), and one of the 30m preset's MLP.
SHAPES = ((384, 144, 640), (2048, 512, 1536))
GEMMS = ("forward", "dgrad", "wgrad")


def _grads(x, w, e, scheme, which: str, simulate: bool):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with (backend.use_backend(which), quant_step(0), torch.autocast(x.device.type, dtype=torch.bfloat16),
          native.simulated() if simulate else contextlib.nullcontext()):
        y = quantized_linear(x, w, scheme, layer=1)
        grads = torch.autograd.grad(y, (x, w), e)
    return (y.detach(), *grads)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest |a − b| in BF16 ulps of b, share of elements that differ)."""
    return native.bf16_ulps(a, b), (a.float() != b.float()).float().mean().item()


def check(device: torch.device, simulate_only: bool, schemes: tuple[str, ...] = SCHEMES) -> list[dict]:
    """One row per (scheme, shape, GEMM) with the differences of each pair of paths."""
    emulated = "triton" if device.type == "cuda" else "reference"
    rows = []
    for name in schemes:
        scheme = get_scheme(name)
        for T, K, N in SHAPES:
            g = torch.Generator().manual_seed(T + K + N)
            x = torch.randn(T, K, generator=g).to(device)
            w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device)
            e = torch.randn(T, N, generator=g).to(device, torch.bfloat16)
            paths = {"emulated": _grads(x, w, e, scheme, emulated, False),
                     "simulated": _grads(x, w, e, scheme, "native", True)}
            if not simulate_only:
                paths["native"] = _grads(x, w, e, scheme, "native", False)
            for i, gemm in enumerate(GEMMS):
                row = {"scheme": name, "shape": f"{T}×{K}×{N}", "gemm": gemm}
                row["simulated vs emulated"] = _ulps(paths["simulated"][i], paths["emulated"][i])
                if "native" in paths:
                    row["native vs simulated"] = _ulps(paths["native"][i], paths["simulated"][i])
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulate", action="store_true",
                   help="compare the simulator with the emulation only (no Blackwell needed)")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-ulps", type=float, default=1.0,
                   help="largest difference accepted, in BF16 ulps of the output (default 1)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    reason = native.unavailable_reason(device)
    if reason is not None and not args.simulate:
        print(f"native NVFP4 GEMMs cannot run here: {reason}. Use --simulate to check the "
              "simulator against the emulation.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}\n")
    rows = check(device, args.simulate, tuple(args.schemes))
    pairs = [k for k in rows[0] if " vs " in k]
    print("| scheme | T×K×N | GEMM | " + " | ".join(f"{k}: max ulps, differing" for k in pairs) + " |")
    print("|---|---|---|" + "---|" * len(pairs))
    worst = 0.0
    for r in rows:
        cells = [f"{r[k][0]:.0f}, {r[k][1]:.2%}" for k in pairs]
        worst = max([worst, *(r[k][0] for k in pairs)])
        print(f"| {r['scheme']} | {r['shape']} | {r['gemm']} | " + " | ".join(cells) + " |")
    ok = worst <= args.max_ulps
    print(f"\nlargest difference: {worst:.0f} BF16 ulp(s): {'ok' if ok else 'FAILED'} (limit {args.max_ulps:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
