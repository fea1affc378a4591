"""Compile the quantization kernels for an H100/H200 (sm_90, the default) or a Blackwell GPU
(``--arch 100``: B200/GB200/B300, ``--arch 120``: RTX 50xx / RTX PRO 6000) without a GPU and
report, per variant, what decides their speed: SASS instructions per quantized element, registers per
thread, spilled bytes, layout conversions, shared-memory loads, barriers and shuffles (from
``triton.compile`` and the ``ptxas -v`` and ``cuobjdump`` that ship with triton).

    python scripts/kernel_report.py                                   # every kernel, the tiles in use
    python scripts/kernel_report.py --kernels rht128_eden --tiles 4x128x1 32x128x8
    python scripts/kernel_report.py --arch 100                        # sm_100a (Blackwell)
    PYTHONPATH=/path/to/triton-3.6 python scripts/kernel_report.py    # the GPU box's triton version

Use the triton version of the GPU you target: builds of the same source differ between versions
(docs/performance.md). Columns and rows are the operand read along its memory rows (``rows``) or
across them (``cols``, A = Xᵀ through strides).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quant.kernels import get_tuning, ops
from quant.kernels import triton_kernels as K

POINTERS = {"x_ptr": "*bf16", "xs_ptr": "*u8", "scale_ptr": "*fp32", "signs_ptr": "*i8",
            "amax_ptr": "*fp32", "u_ptr": "*fp32", "seed_ptr": "*i64", "val_ptr": "*bf16",
            "code_ptr": "*u8", "sc_ptr": "*u8", "st_ptr": "*fp32", "c_ptr": "*fp32"}

# name: (quantizer, rotation size, 4/6, post hoc range alignment, MS-EDEN's energy-weighted S)
KERNELS = {
    "rtn": ("rtn", 0, False, False, False), "rtn46": ("rtn", 0, True, False, False),
    "rtn2d": ("rtn_2d", 0, False, False, False), "rtn2d46": ("rtn_2d", 0, True, False, False),
    "sr": ("sr", 0, False, False, False), "rht16_rtn": ("rtn", 16, False, False, False),
    "rht16_sr": ("sr", 16, False, False, False), "rht32_sr": ("sr", 32, False, False, False),
    "rht128_eden": ("ms_eden", 128, False, False, False),
    "rht128_eden_posthoc": ("ms_eden", 128, False, True, False),
    "rht128_eden_energy": ("ms_eden", 128, False, False, True),
    "rht128_eden_posthoc_energy": ("ms_eden", 128, False, True, True),
}


def ptxas_path(arch: int = 90) -> Path:
    """The ptxas that triton ships for ``arch`` (a separate ``ptxas-blackwell`` for 10.x/12.x,
    where the wheel has one)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    blackwell = bin_dir / "ptxas-blackwell"
    return blackwell if arch >= 100 and blackwell.exists() else bin_dir / "ptxas"


def report(name: str, tile: tuple[int, int, int], cols: bool, draws: str = "philox",
           arch: int = 90) -> dict:
    """Compile one kernel variant for ``sm_<arch>`` and read its resource usage. ``draws``: the Philox
    path (``RAND=1``, an int64 key) or explicit uniforms (``RAND=0``, which the launcher passes
    an FP32 placeholder for the key: the build the GPU tests run)."""
    mode, rot, four_six, posthoc, energy = KERNELS[name]
    bm, bk, warps = tile
    t_t, t_b = ops._targets(mode, four_six)
    meta = ops.tile_meta(bm, max(bk, rot), rot, mode == "rtn_2d")
    groups = ops.whole_groups(mode, rot, four_six)
    tiles = ops._tiles_per_program(ops.layout_of(rot, cols, groups, mode))
    consts = dict(T_TENSOR=t_t, T_BLOCK=t_b, SRC=0, COLS=cols, HAS_SCALE=False, ROT=rot,
                  INV_SQRT=ops._f32(1 / math.sqrt(rot)) if rot else 1.0,
                  MODE=ops.MODES[mode], FOUR_SIX=four_six,
                  TILE2D=mode == "rtn_2d", RAND=int(draws == "philox"), WRITE_VALUES=True,
                  PACK=not posthoc,  # post hoc MS-EDEN serves the backward, which packs nothing
                  POSTHOC=posthoc, ENERGY=energy,
                  TILES=tiles, PREFETCH=ops._prefetches(0, cols, groups, tiles, mode, four_six),
                  # as the launcher builds it for K a multiple of 512
                  SHARED_U=ops._shares_draws(tiles, max(bk, rot), mode, int(draws == "philox"), 512),
                  EVEN=True, GROUPS=groups, **meta,
                  **{"stride_m" if cols else "stride_k": 1})  # the unit stride, as triton specializes it
    fn = K.quant_kernel
    index = {a: i for i, a in enumerate(fn.arg_names)}
    pointers = dict(POINTERS, **({} if draws == "philox" else {"seed_ptr": "*fp32"}))
    signature = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
    aligned = [a for a in fn.arg_names if signature[a].startswith("*")] + [
        a for a in ("M", "K", "P_C", "stride_k" if cols else "stride_m") if signature[a] == "i32"]
    src = ASTSource(fn=fn, signature=signature, constexprs={(index[k],): v for k, v in consts.items()},
                    attrs={(index[a],): [["tt.divisibility", 16]] for a in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": warps, "enable_fp_fusion": False})
    ptx = ck.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        Path(path).write_text(ptx)
        target = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
        built = subprocess.run([str(ptxas_path(arch)), "-v", f"-arch={target}", path, "-o", path + ".o"],
                               capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"{ptxas_path(arch)} could not build {target}: {built.stderr.strip()[-2000:]}")
        log = built.stderr
        sass = subprocess.run([str(ptxas_path(arch).parent / "cuobjdump"), "-sass", path + ".o"],
                              capture_output=True, text=True).stdout
    # Static SASS instructions over the elements each thread quantizes: the issue cost per element
    # (the H200 issues ~33.5·10^12 lane instructions per second, so 60 per element is ~120 µs for
    # 16384×4096, against ~45 µs to move the first pass's bytes).
    per_thread = meta["BM"] * meta["CH"] * meta["R"] * 16 / (warps * 32)  # 16×16 tiles: BM is 16
    instructions = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+\S", sass))

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"SASS instr/elt": round(instructions / per_thread, 1),
            "registers": number(r"Used (\d+) registers"), "spill bytes": number(r"(\d+) bytes spill stores"),
            "layout conversions": ck.asm["ttgir"].count("convert_layout"),
            "shared loads": len(re.findall(r"ld\.shared", ptx)), "barriers": ptx.count("bar.sync"),
            "shuffles": ptx.count("shfl.sync")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--tiles", nargs="+", default=None, metavar="BMxBKxWARPS",
                   help="tiles to compile (default: the ones quant.kernels.ops uses per layout)")
    p.add_argument("--dims", nargs="+", default=["rows", "cols"], choices=["rows", "cols"])
    p.add_argument("--draws", default="philox", choices=["philox", "explicit"],
                   help="the stochastic kernels' draws: Philox (training) or explicit uniforms (tests)")
    p.add_argument("--arch", type=int, default=90, choices=[90, 100, 120],
                   help="compute capability to build for: 90 (Hopper), 100 or 120 (Blackwell)")
    a = p.parse_args()
    if not ptxas_path(a.arch).exists():
        sys.exit(f"no ptxas at {ptxas_path(a.arch)}: this triton wheel has no NVIDIA backend tools")
    print(f"triton {triton.__version__}, target sm_{a.arch} (offline)\n")
    rows = None
    for name in a.kernels:
        rot = KERNELS[name][1]
        for dim in a.dims:
            if a.tiles:
                tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles]
            else:
                mode, _, four_six, *_ = KERNELS[name]
                tiles = [get_tuning().tiles[ops.layout_of(rot, dim == "cols",
                                                          ops.whole_groups(mode, rot, four_six), mode)]]
            for tile in tiles:
                r = report(name, tile, dim == "cols", a.draws, a.arch)
                if rows is None:
                    rows = ["| kernel | dim | tile (BM, BK, warps) | " + " | ".join(r) + " |",
                            "|---|---|---|" + "---|" * len(r)]
                    print("\n".join(rows), flush=True)
                rows.append(f"| {name} | {dim} | {tile} | " + " | ".join(str(v) for v in r.values()) + " |")
                print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
