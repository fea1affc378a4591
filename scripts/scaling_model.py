"""The modelled time of a pre-training run on 8, 64 and 256 GPUs (analysis/scaling.py; a model,
not a measurement), as the markdown table of docs/scaling.md.

    python scripts/scaling_model.py
    python scripts/scaling_model.py --tokens 38e9 --nvlink 360e9 --network 40e9 \
        --tokens-per-s bf16=48861 quartet2=35448
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from analysis.scaling import Links, parameter_count, step

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
    args = p.parse_args(argv)
    preset = yaml.safe_load((REPO / "configs" / "model" / f"{args.model}.yaml").read_text())
    params = parameter_count(preset)
    links = Links(args.nvlink, args.network)
    steps = args.tokens / (args.batch * args.seq_len)
    print(f"{args.model}: {params:,} parameters; {args.tokens:.3g} tokens = {steps:,.0f} steps of "
          f"{args.batch}×{args.seq_len}\n")
    print("| GPUs | layout | scheme | accum | compute s | comm s | bound | step s | hours | GPU-hours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gpus in args.gpus:
        for hsdp in (False, True):
            if hsdp and gpus <= args.gpus_per_node:
                continue
            for entry in args.tokens_per_s:
                scheme, rate = entry.split("=")
                s = step(params, float(rate), gpus=gpus, gpus_per_node=args.gpus_per_node, batch=args.batch,
                         seq_len=args.seq_len, micro_batch=args.micro_batch, links=links, hsdp=hsdp)
                hours = steps * s.time_s / 3600
                print(f"| {gpus} | {s.layout} | {scheme} | {s.accum} | {s.compute_s:.3f} | {s.comm_s:.3f} | "
                      f"{s.bound} | {s.time_s:.3f} | {hours:.1f} | {hours * gpus:,.0f} |")


if __name__ == "__main__":
    main()
