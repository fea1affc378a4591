"""Time train.py itself: tokens/s per scheme and the ratio to BF16, as users run it.

    python scripts/bench_train.py --model 30m --batch 32 --seq 512
    python scripts/bench_train.py --model 30m --batch 64 --seq 512 --vocab 8192
    python scripts/bench_train.py --model 100m --schemes bf16 nvidia tetrajet_v2 four_over_six quartet2
    python scripts/bench_train.py --model 1.9b --fsdp --steps 40            # FSDP2 on one rank
    python scripts/bench_train.py --model 30m -- cuda_graph=false           # any train.py override
    python scripts/bench_train.py --suite                                   # every row of SUITE

Each scheme is one ``python train.py`` run (``torchrun --nproc_per_node N train.py`` with
``--fsdp``, where ``parallel.fsdp=true`` shards even one rank) on the bundled corpus's token
shards, with ``compile=true`` and otherwise train.py's defaults: its loader, logging, validation
and checkpointing all run (a validation and a checkpoint at the end; ``--eval-every`` and
``--ckpt-every`` add more). Tokens/s is train.py's own ``perf/tokens_per_s``, the median over
the log intervals after the first ``--skip`` (those hold compilation and the CUDA-graph
capture); the wall column is the whole run, start-up and compilation included. Prints a
markdown table with the ratio of each scheme's step time to the first scheme's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_scheme(args: argparse.Namespace, scheme: str, run_dir: Path) -> dict:
    """One train.py run of ``scheme`` in ``run_dir``; its median tokens/s, wall time and final losses."""
    overrides = [
        f"quant={scheme}", f"model={args.model}", f"train.batch_size={args.batch}",
        f"train.micro_batch_size={args.micro_batch or args.batch // args.nproc}",
        f"train.seq_len={args.seq}", f"train.steps={args.steps}", f"train.log_every={args.log_every}",
        f"train.eval_every={args.eval_every or args.steps}", f"train.ckpt_every={args.ckpt_every or args.steps}",
        f"data.vocab_size={args.vocab}", f"model.vocab_size={args.vocab}", f"compile={str(args.compile).lower()}",
        "train.eval_batches=1", "train.eval_batch_size=16", "wandb.enabled=false", "resume=false",
        f"run_dir={run_dir}", f"data.cache_dir={args.data_cache}",
        *(["parallel.fsdp=true"] if args.fsdp else []), *args.overrides,
    ]
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}"] if args.fsdp
                else [sys.executable])
    t = time.perf_counter()
    proc = subprocess.run([*launcher, str(REPO / "train.py"), *overrides], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"train.py failed for quant={scheme} (exit {proc.returncode})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r][args.skip:]
    if not tps:
        raise SystemExit(f"quant={scheme}: no log interval after the first {args.skip}; raise --steps")
    return {"tps": statistics.median(tps), "spread": (min(tps), max(tps)), "wall": wall,
            "loss": rows[-1].get("train/loss"), "val": rows[-1].get("val/loss"),
            "mem": max((r.get("perf/peak_memory_gib", 0.0) for r in rows), default=0.0),
            "graph": next((line for line in proc.stdout.splitlines() if "CUDA graph" in line), "")}


SUITE = (
    dict(model="30m", batch=32, vocab=4096, steps=100, fsdp=False),
    dict(model="30m", batch=64, vocab=8192, steps=60, fsdp=False),
    dict(model="100m", batch=32, vocab=4096, steps=60, fsdp=False),
    dict(model="1.9b", batch=32, vocab=4096, steps=30, log_every=5, fsdp=True),
)
"""``--suite``: the settings of docs/performance.md's trainer table (sequence length 512)."""


def table(args: argparse.Namespace, root: Path) -> list[str]:
    """The markdown rows of one setting, every scheme of ``args.schemes``."""
    rows, base = [], None
    for scheme in args.schemes:
        r = run_scheme(args, scheme, root / f"{args.model}-{args.batch}-{args.vocab}-{scheme}")
        base = base or r["tps"]
        if r["graph"]:
            print(f"  {scheme}: {r['graph'].strip()}")
        rows.append(f"| {args.model}, {args.batch}×{args.seq}, vocabulary {args.vocab}"
                    f"{', FSDP2' if args.fsdp else ''} | {scheme} | {r['tps']:,.0f} | "
                    f"{r['spread'][0]:,.0f}–{r['spread'][1]:,.0f} | {base / r['tps']:.2f} | {r['wall']:.0f} | "
                    f"{r['mem']:.1f} | {r['loss']:.4f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="30m")
    p.add_argument("--schemes", nargs="+", default=["bf16", "nvidia", "tetrajet_v2", "four_over_six", "quartet2"])
    p.add_argument("--batch", type=int, default=32, help="sequences per step (train.batch_size)")
    p.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_size (default: batch / ranks)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096, help="the bundled corpus's tokenizer size (and the model's)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="log intervals left out of the median (compilation)")
    p.add_argument("--eval-every", type=int, default=None, help="default: once, at the end")
    p.add_argument("--ckpt-every", type=int, default=None, help="default: once, at the end")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="train.py's compile")
    p.add_argument("--fsdp", action="store_true", help="torchrun with parallel.fsdp=true")
    p.add_argument("--nproc", type=int, default=1, help="ranks with --fsdp")
    p.add_argument("--data-cache", default=str(REPO / "data" / "cache"))
    p.add_argument("--keep", default=None, help="keep the run directories here (default: a temporary one)")
    p.add_argument("--suite", action="store_true", help="every setting of SUITE in turn (--model, --batch, "
                   "--vocab, --steps, --fsdp as it says)")
    p.add_argument("overrides", nargs="*", help="more train.py overrides (after --)")
    args = p.parse_args()
    ranks = f"FSDP2 on {args.nproc} rank(s)" if args.fsdp else "1 process"
    setting = ("the settings of SUITE" if args.suite else
               f"model {args.model}, {args.batch}×{args.seq} tokens/step, vocabulary {args.vocab}, "
               f"{args.steps} steps, {ranks}")
    print(f"train.py: {setting}, compile={str(args.compile).lower()}"
          + (f", overrides {' '.join(args.overrides)}" if args.overrides else ""), flush=True)
    rows = ["| setting | scheme | tokens/s (median) | range | × first scheme | wall (s) | peak mem (GiB) "
            "| final train loss |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for setting in SUITE if args.suite else ({},):
            rows += table(argparse.Namespace(**{**vars(args), **setting}), root)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
