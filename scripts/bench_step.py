"""Time full training steps (forward, backward, AdamW) of a model preset under several schemes.

    python scripts/bench_step.py --model 1.9b --schemes bf16 quartet2 --ac none full
    python scripts/bench_step.py --model 100m --batch 32 --seq 512 --compile
    python scripts/bench_step.py --model 100m --schemes quartet2 --profile 20   # where the time goes
    python scripts/bench_step.py --model 100m --schemes quartet2 --compile --profile-ops  # by operand
    python scripts/bench_step.py --model 100m --compile --cuda-graph           # no host overhead
    python scripts/bench_step.py --model 100m --compile --compile-mode reduce-overhead  # blocks as CUDA graphs
    torchrun --nproc_per_node 8 scripts/bench_step.py --model 1.9b --fsdp --batch 16

One device per process. With ``--fsdp`` the model is sharded with FSDP2 over all ranks (also on
one rank, for a like-for-like baseline) and ``--batch`` is per GPU, so tokens/s per GPU against the
one-GPU run gives the scaling efficiency.

The model is built on meta, converted with ``quant.quantize_model``,
parallelized (activation checkpointing, compile) and materialized exactly as train.py does, and
trained on random tokens under BF16 autocast. ``--cuda-graph`` captures the whole step (forward,
backward, clipping, AdamW) in one CUDA graph after the warm-up and times its replays, so the host
launch overhead drops out for every scheme alike (the quantizers' draws are read on the device
from ``quant.randomness.step_key``, so each replay still draws afresh). ``--profile N`` runs one
more step (a replay, with ``--cuda-graph``) under the profiler. ``--profile-ops`` profiles the
last warm-up step (never a graph replay, whose host ranges the profiler cannot see) and gives
each quantization of the fused kernels its own row, named after its operand: quantizer, source,
rows or columns, shape, with its kernels' device time (the align pass and fills included).
Prints a markdown table: median step time, tokens/s, MFU against the measured or given BF16
peak, peak memory, and the ratio to the first scheme with the same settings. Needs only torch and
PyYAML (no Hydra), so it runs on a bare GPU box; without the project installed, run it from the
repository root as a module: ``python -m scripts.bench_step ...`` (``torchrun ... -m scripts.bench_step``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

import quant
from model import build_model
from model.parallel import COMPILE_MODES, materialize, parallelize, replays_cuda_graphs
from scripts.cuda_graph import capture
from training.optim import build_adamw
from training.tracking import bf16_peak_flops

REPO = Path(__file__).resolve().parents[1]


def step_times(args: argparse.Namespace, scheme: str, ac: str, device: torch.device, mesh=None) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "model" / f"{args.model}.yaml").read_text())
    cfg["max_seq_len"] = max(cfg["max_seq_len"], args.seq)
    cfg["vocab_size"] = args.vocab or cfg["vocab_size"]
    model = build_model(cfg, device="meta")
    quant.quantize_model(model, scheme)
    flops_per_token = model.flops_per_token(args.seq)
    parallelize(model, mesh, activation_checkpointing=ac, compile=args.compile, compile_mode=args.compile_mode)
    materialize(model, device, seed=0)
    opt = build_adamw(model, 1e-4, (0.9, 0.95), 0.1)
    if args.cuda_graph:
        for group in opt.param_groups:
            group["capturable"] = True  # AdamW keeps its step counts on the device
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.empty((args.batch, args.seq + 1), dtype=torch.long, device=device)

    graphs = replays_cuda_graphs(args.compile, args.compile_mode)

    def step() -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # autocast's cast cache must be off inside a CUDA graph capture
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not args.cuda_graph):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # keeps no autograd graph (and its AccumulateGrad nodes) alive

    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    graph = None
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit("--cuda-graph needs a CUDA device")
    # with --cuda-graph every step runs on the capture's stream (scripts/cuda_graph.capture)
    stream = torch.cuda.Stream() if args.cuda_graph else None
    with torch.cuda.stream(stream):
        for i in range(args.warmup + args.steps):
            tokens.copy_(torch.randint(0, cfg["vocab_size"], tokens.shape, device=device, generator=g))
            quant.set_quant_step(i)
            if args.cuda_graph and i == args.warmup:
                graph, loss = capture(step, stream)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            if graph is not None:
                graph.replay()
            elif args.profile_ops and i == args.warmup - 1:
                with profile_operands(device):
                    loss = step()
            else:
                loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if args.profile:
        tokens.copy_(torch.randint(0, cfg["vocab_size"], tokens.shape, device=device, generator=g))
        # the step as it was timed (with --cuda-graph, a replay)
        profile_step(graph.replay if graph is not None else step, device, args.profile)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    model = opt = None  # frees them: step() holds the same cells
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms": med * 1e3, "tps": tokens / med, "flops": flops_per_token * tokens / med, "mem": peak_mem,
            "loss": loss.item()}


@contextmanager
def _labelled_quantizations():
    """Wrap every kernel quantization (``quant.kernels.ops.quantize``, which the custom ops and
    the eager path call) in a profiler range named after its operand."""
    from quant.kernels import ops as kops

    inner = kops.quantize

    def labelled(call):
        M, K, _, sk, _, pt = kops._operand(call.x, call.src, call.transpose)
        name = (f"{call.mode}{'+4/6' if call.four_over_six else ''}"
                f"{' post hoc' if call.posthoc else ''}"
                f"{f' RHT{call.signs.numel()}' if call.signs is not None else ''}"
                f"{' packed' if call.src != kops.SRC_DENSE else ''}"
                f" {'cols' if kops._is_cols(call.src, sk, pt) else 'rows'} {M}×{K}")
        with torch.profiler.record_function("nvfp4 " + name):
            return inner(call)

    kops.quantize = labelled
    try:
        yield
    finally:
        kops.quantize = inner


@contextmanager
def profile_operands(device: torch.device):
    """Profile the enclosed step and print each operand's quantizations (``--profile-ops``):
    calls, device time (host time on CPU) and time per million elements."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof, _labelled_quantizations():
        yield
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith("nvfp4 "):
            t = e.device_time_total if device.type == "cuda" else e.cpu_time_total
            rows.setdefault(e.name[6:], []).append(t)
    total = sum(sum(v) for v in rows.values())
    clock = "device" if device.type == "cuda" else "host"
    print(f"\nquantizations of one step by operand ({clock} time {total / 1e3:.2f} ms):")
    print("| quantizer, source, direction, M×K | calls | time (ms) | µs/call | µs per M elements |")
    print("|---|---|---|---|---|")
    for name, ts in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        m, k = (int(v) for v in name.rsplit(" ", 1)[1].split("×"))
        per = sum(ts) / len(ts)
        print(f"| {name} | {len(ts)} | {sum(ts) / 1e3:.2f} | {per:.1f} | {per / (m * k / 1e6):.2f} |")


def profile_step(step, device: torch.device, top: int) -> None:
    """One more ``step()`` under ``torch.profiler``: the device kernels grouped by name, with their
    share of the step's device time (where the time of a quantized step goes)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":  # device kernels only (host ranges would count their kernels again)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        rows = [(k, sum(v), len(v)) for k, v in by_name.items()]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    total = sum(r[1] for r in rows) or 1.0
    clock = "device" if device.type == "cuda" else "CPU"
    print(f"\nprofile of one step ({clock} time {total / 1e3:.1f} ms; top kernels):")
    print("| kernel | calls | time (ms) | share |\n|---|---|---|---|")
    for name, t, n in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"| {name[:90]} | {n} | {t / 1e3:.2f} | {t / total:.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a configs/model preset")
    p.add_argument("--schemes", nargs="+", default=["bf16", "quartet2"])
    p.add_argument("--ac", nargs="+", default=["none"], help="activation checkpointing modes to time")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile mode (reduce-overhead: each block replayed as CUDA graphs)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of the whole step captured in one CUDA graph (no host overhead)")
    p.add_argument("--peak-flops", type=float, default=None, help="BF16 peak FLOP/s for MFU")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 over all ranks (torchrun)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step and print its N most expensive kernels")
    p.add_argument("--profile-ops", action="store_true",
                   help="profile the last warm-up step and print the kernel quantizations by operand")
    a = p.parse_args()
    if a.profile_ops and a.warmup < 2:
        p.error("--profile-ops profiles the last warm-up step, which must not be the first "
                "(it compiles): use --warmup 2 or more")
    mesh, world = None, 1
    if a.fsdp:
        from training.distributed import init_distributed

        di = init_distributed("auto", shard_alone=True)
        mesh, device, world = di.mesh, di.device, di.world_size
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = bf16_peak_flops(device, a.peak_flops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name} ×{world}, torch {torch.__version__}, model {a.model}, {a.batch}×{a.seq} tokens/step/GPU, "
          f"compile={a.compile} ({a.compile_mode}), cuda_graph={a.cuda_graph}, {a.steps} timed steps after "
          f"{a.warmup} warm-up\n")
    rows = ["| scheme | activation ckpt | step (ms) | tokens/s/GPU | MFU vs BF16 peak | peak mem (GiB) "
            "| × first scheme |",
            "|---|---|---|---|---|---|---|"]
    for ac in a.ac:
        base = None
        for scheme in a.schemes:
            r = step_times(a, scheme, ac, device, mesh)
            base = base or r["ms"]
            mfu = f"{r['flops'] / peak:.1%}" if peak else "n/a"
            rows.append(f"| {scheme} | {ac} | {r['ms']:.1f} | {r['tps']:.0f} | {mfu} | {r['mem']:.1f} | "
                        f"{r['ms'] / base:.2f} |")
            if int(os.environ.get("RANK", "0")) == 0:
                print(rows[-1], flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
