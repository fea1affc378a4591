"""Bandwidth of each NVFP4 Triton quantizer against the device's copy bandwidth.

    python scripts/bench_kernels.py                      # 16384×4096 BF16, rows and columns
    python scripts/bench_kernels.py --sweep              # try the SWEEP tile shapes of every layout
    python scripts/bench_kernels.py --sweep rows_eden --only eden   # one layout, some kernels

Every kernel quantizes a BF16 ``M × K`` input (or, for the ``packed source`` cases, its packed
RTN+4/6 form, as the backward reads the saved X̂) along its rows (``A = X``) or its columns
(``A = Xᵀ``: for the quantizers of ``quant.kernels.ops.whole_groups`` on dense sources, loaded
by slices; otherwise the transpose pass, then the row kernel; ``quant.kernels.KernelTuning``'s
``sliced_sources`` and ``transpose_cols``). The table shows the tile of the kernel that
quantizes. Time = the whole op: the amax pass (reads X, rotating it when the quantizer rotates)
and the quantization pass (reads X again, writes BF16 values and, when ``pack``, the 4.5-bit
form), plus the transpose where there is one. Bytes = what the amax and quantization passes move
(a transpose's extra read and write are not counted):
``2·|X|`` read + values (+ packed codes and scales) written (post hoc MS-EDEN: one read of X,
its values, codes and corrected scales written, the corrected scales read back). The table gives the achieved
bandwidth as a fraction of the measured device-to-device copy bandwidth (``clone`` of the same
input, read+write), the time relative to that copy, and the share each kernel aims for
(``target``): 75% for RTN, SR and 4/6, 60% for the fused rotations.
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch

from scripts.cuda_graph import capture

# Tile configs timed by --sweep, per operand layout (quant.kernels.tuning.LAYOUTS). "cols_groups"
# is the column path of the quantizers that hold whole groups per thread (ops.whole_groups); the
# other column layouts are the in-kernel transpose's, which the GPU uses only with
# KernelTuning.transpose_cols off.
SWEEP = {
    "rows": [(8, 128, 2), (16, 128, 2), (8, 128, 1), (16, 128, 4), (32, 128, 4)],
    "rows_2d": [(16, 128, 8), (16, 128, 4), (16, 256, 8)],
    "rows_wide": [(8, 128, 1), (4, 128, 1), (16, 128, 1), (16, 128, 2)],
    "rows_eden": [(4, 128, 1), (8, 128, 1), (2, 256, 1), (16, 128, 1)],
    "cols": [(32, 64, 4), (16, 128, 4), (32, 128, 8), (64, 32, 4)],
    "cols_wide": [(16, 128, 4), (32, 128, 8), (16, 128, 2), (32, 128, 4)],
    "cols_groups": [(8, 128, 1), (4, 128, 1), (8, 256, 1)],
    "cols_eden": [(8, 128, 1), (4, 128, 1), (8, 256, 1)],
}


def bench(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median time of ``fn()`` in seconds (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_graph(fn, reps: int = 10, iters: int = 10) -> float | None:
    """GPU-only time of ``fn()`` (no Python/launch overhead): ``reps`` calls captured in a CUDA
    graph, replayed; median per call. None when capture fails."""
    try:
        fn()
        g, _ = capture(lambda: [fn() for _ in range(reps)])
        return bench(g.replay, iters, 2) / reps
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def cases(x: torch.Tensor):
    from quant import kernels as K
    from quant.hadamard import random_signs

    dev = x.device
    g = torch.Generator(device=dev).manual_seed(0)
    seed = torch.randint(0, 2**62, (1,), generator=g, device=dev, dtype=torch.int64)
    s128, s32, s16 = (random_signs(h, g, dev) for h in (128, 32, 16))
    # name, target, fn(transpose), bytes moved per element: amax pass (read 2) + quantization
    # pass (read 2, values 2, + 0.5625 with the packed form); post hoc MS-EDEN without the
    # packed form: read 2, values 2, the corrected scales and their roundings 0.5 written (the
    # align pass reads them back only for the rare groups whose values depend on the tensor
    # scale; the first pass writes no codes without the packed form)
    amax_bytes, packed_bytes = 6.0, 6.0 + 0.5625
    posthoc_bytes = 2 + 2 + 0.5
    # packed sources (the saved X̂ and Ŵ of quartet2 and tetrajet_v2): 0.5625 bytes read per
    # element instead of 2 (twice with an amax pass)
    _, codes, scales, st, _ = K.rtn(x, False, True, None, True)
    codes, scales = codes.contiguous(), scales.view(torch.uint8).contiguous()
    # quartet2's E of qkv: each 512-token sequence's first token has a zero query gradient, so
    # the query groups of every 512th row lie far below the rest and post hoc MS-EDEN's align
    # pass must fix them (docs/performance.md, "Where the time goes")
    x_fix = x.clone()
    x_fix[::512, : x.shape[1] // 3] *= 2.0**-30

    def from_packed(t, mode, signs, posthoc=False):
        return K.quantize_operand(codes, scales, 1, t, st, signs, None, None, seed, 0, mode, False,
                                  True, False, posthoc)
    return [
        ("rtn 1x16", 0.75, lambda t: K.rtn(x, t, False, None, True), packed_bytes),
        ("rtn 1x16 + 4/6", 0.75, lambda t: K.rtn(x, t, True, None, True), packed_bytes),
        ("rtn 16x16", 0.75, lambda t: K.rtn_2d(x, t, False, None, True), packed_bytes),
        ("rtn 16x16 + 4/6", 0.75, lambda t: K.rtn_2d(x, t, True, None, True), packed_bytes),
        ("sr 1x16", 0.75, lambda t: K.sr(x, t, None, seed, False, None, False), amax_bytes),
        ("rht16 + rtn (nvidia Xᵀ)", 0.60, lambda t: K.rht_rtn(x, s16, t, None, False), amax_bytes),
        ("rht16 + sr (nvidia Eᵀ)", 0.60, lambda t: K.rht_sr(x, s16, t, None, seed, None, False), amax_bytes),
        ("rht32 + sr (tetrajet_v2)", 0.60, lambda t: K.rht_sr(x, s32, t, None, seed, None, False), amax_bytes),
        ("rht128 + ms-eden, amax pass", 0.60,
         lambda t: K.rht_ms_eden(x, s128, t, None, seed, None, False), amax_bytes),
        ("rht128 + ms-eden, post hoc (quartet2)", 0.60,
         lambda t: K.rht_ms_eden(x, s128, t, None, seed, None, False, posthoc=True), posthoc_bytes),
        ("rht128 + ms-eden, post hoc, energy (quartet2 eden_correction=energy)", 0.60,
         lambda t: K.rht_ms_eden(x, s128, t, None, seed, None, False, posthoc=True,
                                 eden_correction="energy"), posthoc_bytes),
        ("rht128 + ms-eden, post hoc, rows to fix (quartet2 E of qkv)", 0.60,
         lambda t: K.rht_ms_eden(x_fix, s128, t, None, seed, None, False, posthoc=True),
         posthoc_bytes),
        ("rht32 + sr, packed source (tetrajet_v2 X̂ᵀ)", 0.60,
         lambda t: from_packed(t, "sr", s32), amax_bytes - 4 + 2 * 0.5625),
        ("rht128 + ms-eden, post hoc, packed source (quartet2 X̂ᵀ)", 0.60,
         lambda t: from_packed(t, "ms_eden", s128, True), posthoc_bytes - 2 + 0.5625),
    ]


def check() -> None:
    """Bit-exactness of every kernel on this device against the reference on CPU copies; prints
    mismatch counts and where the first mismatches sit (row, column) for failing cases."""
    from quant import kernels as K
    from quant.hadamard import random_signs, rotate
    from quant.quantizers import quantize_ms_eden, quantize_rtn, quantize_rtn_2d, quantize_sr

    dev = torch.device("cuda")
    for shape in [(48, 160), (144, 256), (1024, 4096)]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[1])
        for t in (False, True):
            a = x.t() if t else x
            kdim = a.shape[1]
            h = next(h for h in (128, 32, 16) if kdim % h == 0)
            sg = random_signs(h, g, "cpu")
            s16 = random_signs(16, g, "cpu")
            u = torch.rand(a.shape, generator=g)
            ug = torch.rand(a.shape[0], kdim // 16, generator=g)
            xd = x.to(dev)
            cases = [
                ("rtn", lambda: K.rtn(xd, t), lambda: quantize_rtn(a)),
                ("rtn46", lambda: K.rtn(xd, t, True), lambda: quantize_rtn(a, four_over_six=True)),
                ("rtn2d46", lambda: K.rtn_2d(xd, t, True), lambda: quantize_rtn_2d(a, four_over_six=True)),
                ("sr", lambda: K.sr(xd, t, u.to(dev)), lambda: quantize_sr(a, u)),
                ("rht16_rtn", lambda: K.rht_rtn(xd, s16.to(dev), t), lambda: quantize_rtn(rotate(a, s16))),
                ("rht16_sr", lambda: K.rht_sr(xd, s16.to(dev), t, u.to(dev)), lambda: quantize_sr(rotate(a, s16), u)),
                (f"rht{h}_rtn", lambda: K.rht_rtn(xd, sg.to(dev), t), lambda: quantize_rtn(rotate(a, sg))),
                (f"rht{h}_sr", lambda: K.rht_sr(xd, sg.to(dev), t, u.to(dev)), lambda: quantize_sr(rotate(a, sg), u)),
                (f"rht{h}_eden", lambda: K.rht_ms_eden(xd, sg.to(dev), t, ug.to(dev)),
                 lambda: quantize_ms_eden(rotate(a, sg), ug, chunk=h)),
                (f"rht{h}_eden_posthoc", lambda: K.rht_ms_eden(xd, sg.to(dev), t, ug.to(dev), posthoc=True),
                 lambda: quantize_ms_eden(rotate(a, sg), ug, chunk=h, posthoc=True)),
                (f"rht{h}_eden_energy",
                 lambda: K.rht_ms_eden(xd, sg.to(dev), t, ug.to(dev), eden_correction="energy"),
                 lambda: quantize_ms_eden(rotate(a, sg), ug, chunk=h, correction="energy")),
                (f"rht{h}_eden_posthoc_energy",
                 lambda: K.rht_ms_eden(xd, sg.to(dev), t, ug.to(dev), posthoc=True, eden_correction="energy"),
                 lambda: quantize_ms_eden(rotate(a, sg), ug, chunk=h, posthoc=True, correction="energy")),
            ]
            q46 = quantize_rtn(a, four_over_six=True)
            pk = q46.pack()
            cases.append(("unpack", lambda: (K.unpack(pk.data.to(dev), pk.scales.to(dev)),),
                          lambda: q46))
            for name, kern, ref in cases:
                try:
                    v = kern()[0].float().cpu()
                    r = ref()  # post hoc values carry the tensor scale
                    r = (r.dequantize() if "posthoc" in name else r.scaled_values()).bfloat16().float()
                    bad = (v.view(torch.int32) != r.view(torch.int32)).nonzero()
                    msg = "ok" if len(bad) == 0 else (
                        f"{len(bad)} mismatches; rows {bad[:, 0].unique()[:8].tolist()} "
                        f"cols {bad[:, 1].unique()[:12].tolist()} "
                        f"e.g. {v[tuple(bad[0])].item()} vs {r[tuple(bad[0])].item()}")
                except Exception as e:  # noqa: BLE001
                    msg = f"error {type(e).__name__}: {str(e)[:150]}"
                print(f"check {shape} {'cols' if t else 'rows'} {name}: {msg}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", nargs="*", default=None, metavar="LAYOUT",
                   help="time the kernels under the SWEEP tile configs of these layouts (none named: all)")
    p.add_argument("--only", nargs="*", default=None, help="substrings of kernel names to run")
    p.add_argument("--check", action="store_true", help="only check bit-exactness on this device")
    a = p.parse_args()
    if a.check:
        check()
        return
    import triton

    from quant.kernels import get_tuning, ops, tuning_from_mapping, use_tuning

    dev = torch.device("cuda")
    x = torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    copy_s = bench_graph(lambda: x.clone()) or bench(lambda: x.clone(), a.iters)
    copy_bw = 4 * n / copy_s
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"input {a.rows}×{a.cols} BF16; copy (clone) {copy_s * 1e6:.1f} µs = {copy_bw / 1e12:.2f} TB/s\n")
    rows = ["| kernel | dim | (BM, BK, warps) | GPU time (µs) | × copy | GB moved | TB/s | % of copy bw | target | "
            "eager call (µs) |", "|---|---|---|---|---|---|---|---|---|---|"]

    def run(name, target, fn, bytes_per_element, t, cfg):
        dim = "cols" if t else "rows"
        try:
            eager = bench(lambda: fn(t), a.iters)
            s = bench_graph(lambda: fn(t)) or eager
        except Exception as e:  # report and go on
            rows.append(f"| {name} | {dim} | {cfg} | failed: {type(e).__name__}: {str(e)[:80]} |")
            print(rows[-1], flush=True)
            return float("inf")
        moved = bytes_per_element * n
        bw = moved / s
        rows.append(f"| {name} | {dim} | {cfg} | {s * 1e6:.1f} | {s / copy_s:.2f} | {moved / 1e9:.2f} | "
                    f"{bw / 1e12:.2f} | {bw / copy_bw:.0%} | {target:.0%} | {eager * 1e6:.0f} |")
        print(rows[-1], flush=True)
        return s

    def layout(name: str, t: bool) -> str:
        """The tile layout the op really uses (columns that ``ops._transposes_first`` run the row
        kernels after the transpose; the others load columns by slices)."""
        rotation = re.match(r"rht(\d+)", name)
        rot = int(rotation.group(1)) if rotation else 0
        mode = ("rtn_2d" if "16x16" in name else "ms_eden" if "eden" in name
                else "sr" if " sr" in f" {name}" else "rtn")
        groups = ops.whole_groups(mode, rot, "4/6" in name)
        src = ops.SRC_PACKED if "packed" in name else ops.SRC_DENSE
        cols = t and not ops._transposes_first(src, t, groups, mode, get_tuning())
        return ops.layout_of(rot, cols, groups, mode)

    selected = [c for c in cases(x) if not a.only or any(s in c[0] for s in a.only)]
    if a.sweep is not None:
        best = {}
        for lay, cfgs in SWEEP.items():
            if a.sweep and lay not in a.sweep:
                continue
            for cfg in cfgs:
                with use_tuning(tuning_from_mapping({"tiles": {lay: cfg}})):
                    total = sum(run(name, target, fn, nbytes, t, cfg)
                                for name, target, fn, nbytes in selected for t in (False, True)
                                if layout(name, t) == lay)
                if total and total < best.get(lay, (float("inf"),))[0]:
                    best[lay] = (total, cfg)
        for lay, (total, cfg) in best.items():  # KernelTuning(tiles={lay: cfg})
            print(f"best {lay}: {cfg} ({total * 1e6:.0f} µs over its kernels)")
    else:
        for name, target, fn, nbytes in selected:
            for t in (False, True):
                run(name, target, fn, nbytes, t, get_tuning().tiles[layout(name, t)])
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
