"""The modelled time of a pre-training run on 8, 64 and 256 GPUs (analysis/scaling.py; a model,
not a measurement), as the markdown table of docs/scaling.md; ``--gather-table``: the bytes each
rank all-gathers per step for every model preset, in BF16 and in NVFP4.

    python scripts/scaling_model.py
    python scripts/scaling_model.py --tokens 38e9 --nvlink 360e9 --network 40e9 \
        --tokens-per-s bf16=48861 quartet2=35448
    python scripts/scaling_model.py --gather-table
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from analysis.scaling import Links, gather_bytes, parameter_count, step

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.9b", help="a configs/model preset")
    p.add_argument("--tokens", type=float, default=38e9, help="the run's token budget")
    p.add_argument("--batch", type=int, default=512, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per rank and micro-batch")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink", type=float, default=360e9, help="ring bandwidth within a node, bytes/s")
    p.add_argument("--network", type=float, default=40e9, help="ring bandwidth per GPU between nodes, bytes/s")
    p.add_argument("--tokens-per-s", nargs="+", default=["bf16=48861", "quartet2=35448"],
                   help="SCHEME=tokens/s of one GPU under FSDP2 (scripts/bench_train.py --fsdp)")
    p.add_argument("--gather-table", action="store_true",
                   help="print the bytes all-gathered per rank and step for every preset instead")
    args = p.parse_args(argv)
    if args.gather_table:
        return gather_table(args.gpus_per_node)
    preset = _preset(args.model)
    params = parameter_count(preset)
    links = Links(args.nvlink, args.network)
    steps = args.tokens / (args.batch * args.seq_len)
    print(f"{args.model}: {params:,} parameters; {args.tokens:.3g} tokens = {steps:,.0f} steps of "
          f"{args.batch}×{args.seq_len}\n")
    print("| GPUs | layout | scheme | weight gather | accum | compute s | comm s | bound | step s | hours | "
          "GPU-hours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for gpus in args.gpus:
        for hsdp in (False, True):
            if hsdp and gpus <= args.gpus_per_node:
                continue
            shards = args.gpus_per_node if hsdp and gpus > args.gpus_per_node else gpus
            for entry in args.tokens_per_s:
                scheme, rate = entry.split("=")
                for gather in ("bf16",) if scheme == "bf16" else ("bf16", "nvfp4"):
                    s = step(params, float(rate), gpus=gpus, gpus_per_node=args.gpus_per_node, batch=args.batch,
                             seq_len=args.seq_len, micro_batch=args.micro_batch, links=links, hsdp=hsdp,
                             gather=sum(gather_bytes(preset, scheme, gather, shards).values()))
                    hours = steps * s.time_s / 3600
                    print(f"| {gpus} | {s.layout} | {scheme} | {gather} | {s.accum} | {s.compute_s:.3f} | "
                          f"{s.comm_s:.3f} | {s.bound} | {s.time_s:.3f} | {hours:.1f} | {hours * gpus:,.0f} |")


def _preset(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text())


PRESETS = ("tiny", "30m", "50m", "100m", "200m", "1.9b")


def gather_table(shards: int) -> None:
    """Per preset: GB each rank all-gathers per micro-batch (before the forward and again before
    the backward) over ``shards`` ranks, of the block linears' weights and of the whole model,
    in BF16 and as quartet2's and nvidia's NVFP4 Ŵ."""
    frac = 2 * (shards - 1) / shards / 1e9
    print("| preset | parameters | block linears: BF16 GB | quartet2 NVFP4 | nvidia NVFP4 | "
          "whole model: BF16 GB | quartet2 NVFP4 | nvidia NVFP4 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in PRESETS:
        preset = _preset(name)
        bf16 = gather_bytes(preset, "quartet2", "bf16", shards)
        q2, nv = (gather_bytes(preset, s, "nvfp4", shards) for s in ("quartet2", "nvidia"))
        lin = [g["quantized_linears"] * frac for g in (bf16, q2, nv)]
        whole = [sum(g.values()) * frac for g in (bf16, q2, nv)]
        print(f"| {name} | {parameter_count(preset):,} | {lin[0]:.3f} | {lin[1]:.3f} ({lin[0] / lin[1]:.2f}×) | "
              f"{lin[2]:.3f} ({lin[0] / lin[2]:.2f}×) | {whole[0]:.3f} | {whole[1]:.3f} ({whole[0] / whole[1]:.2f}×) | "
              f"{whole[2]:.3f} ({whole[0] / whole[2]:.2f}×) |")

if __name__ == "__main__":
    main()
