"""Pre-train a Llama model whose block linears run in NVFP4 (or BF16).

    python train.py                                   # tiny model, quartet2, bundled corpus, CPU is fine
    python train.py quant=nvidia model=30m train.tokens_per_param=100
    python train.py quant=quartet2 model=1.9b data=c4 data.tokenizer_path=/path/to/tokenizer.model

The loop, top to bottom: build data, model and optimizer; resume from the newest checkpoint of the
run directory if there is one; then, for every optimizer step, set the learning rate, run the
micro-batches (forward under BF16 autocast, backward), stop on a non-finite loss, clip, step, log,
validate and checkpoint. Configs live in configs/ (Hydra); see README.md.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

import quant
from data.loader import TokenLoader, val_batches
from data.prepare import load_manifest, prepare_from_config
from data.tokenizer import check_vocab
from model import build_model
from quant import randomness
from model.parallel import materialize, parallelize, replays_cuda_graphs
from training.checkpoint import Checkpointer, check_fingerprint, config_fingerprint, read_extra
from training.distributed import DistInfo, all_reduce_mean, any_rank, barrier, init_distributed, shutdown
from training.metrics import bf16_peak_flops, mfu, peak_memory_gib
from training.optim import build_adamw
from training.preemption import PreemptionWatcher
from training.schedule import lr_at
from training.tracking import NullTracker, Tracker


def _budget(steps: Any, tokens_per_param: Any) -> str:
    return f"{tokens_per_param}tpp" if tokens_per_param not in (None, "None", "null") else f"{steps}steps"


OmegaConf.register_new_resolver("budget", _budget, replace=True)


class TrainingError(RuntimeError):
    """A run stopped for a reason the user can act on; the message says what and how."""


class Preempted(Exception):
    """The run checkpointed on a stop request and exits so that Slurm can requeue it."""


def scheme_from_config(qcfg: DictConfig) -> quant.Scheme:
    return quant.get_scheme(
        qcfg.name,
        forward=qcfg.forward,
        backward=qcfg.backward,
        rotation=qcfg.rotation,
        four_over_six=qcfg.four_over_six,
        sr_four_over_six=qcfg.sr_four_over_six,
        delayed_amax=qcfg.delayed_amax,
        range_alignment=qcfg.range_alignment,
    )


def skip_patterns(qcfg: DictConfig, n_layer: int) -> list[str]:
    patterns = list(qcfg.skip)
    if qcfg.get("keep_edge_blocks"):
        patterns += quant.edge_block_patterns(n_layer, qcfg.keep_edge_blocks.first, qcfg.keep_edge_blocks.last)
    return patterns


def total_steps(cfg: DictConfig, non_embedding_params: int) -> int:
    """The token budget in optimizer steps: ``train.steps``, or ``tokens_per_param × N`` tokens."""
    if cfg.train.tokens_per_param is not None:
        tokens = cfg.train.tokens_per_param * non_embedding_params
        return max(1, math.ceil(tokens / (cfg.train.batch_size * cfg.train.seq_len)))
    if not cfg.train.steps or cfg.train.steps < 1:
        raise TrainingError("set a token budget: train.steps=N or train.tokens_per_param=T")
    return int(cfg.train.steps)


@torch.no_grad()
def evaluate(model, data_dir: Path, cfg: DictConfig, di: DistInfo, autocast: bool) -> float:
    """Mean validation loss over a fixed set of held-out batches (each rank takes its share)."""
    model.eval()
    losses = []
    batches = val_batches(data_dir, cfg.train.seq_len, cfg.train.eval_batch_size, cfg.train.eval_batches,
                          rank=di.rank, world_size=di.world_size)
    graphs = replays_cuda_graphs(cfg.compile, cfg.compile_mode)
    for x, y in batches:
        if graphs:  # each validation batch: the last one's graph outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(di.device.type, dtype=torch.bfloat16, enabled=autocast):
            losses.append(model(x.to(di.device), y.to(di.device)).float())
    model.train()
    return all_reduce_mean(torch.stack(losses).mean()).item()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics (also in ``run_dir/summary.json``).

    Works in one process or under torchrun/srun (FSDP2 over all ranks, see model/parallel.py).
    """
    dist_info = init_distributed(cfg.device, cfg.parallel.replicate)
    try:
        summary = _train(cfg, dist_info)
        barrier()  # every rank is done before any tears the process group down
        return summary
    finally:
        shutdown()


def _train(cfg: DictConfig, di: DistInfo) -> dict[str, Any]:
    """Watch for stop requests from the very start (a stale request of an earlier job is
    cleared), then train."""
    run_dir = Path(cfg.run_dir or hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    preemption = PreemptionWatcher(run_dir)
    if di.is_main:
        preemption.clear()
    try:
        return _train_run(cfg, di, run_dir, preemption)
    finally:
        preemption.close()


def _train_run(cfg: DictConfig, di: DistInfo, run_dir: Path, preemption: PreemptionWatcher) -> dict[str, Any]:
    device, main_rank = di.device, di.is_main
    autocast = cfg.precision == "bf16"
    torch.manual_seed(cfg.seed)
    quant.set_quant_rng(seed=cfg.seed, rank=di.rank)

    # Data: rank 0 prepares the token shards if needed (bundled corpus by default), then the rest.
    if main_rank:
        data_dir = prepare_from_config(cfg.data)
    barrier()
    if not main_rank:
        data_dir = prepare_from_config(cfg.data)
    check_vocab(load_manifest(data_dir)["vocab_size"], cfg.model.vocab_size)
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainingError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}. "
            f"Fix: lower train.seq_len or raise model.max_seq_len."
        )
    rows_per_rank, rem = divmod(cfg.train.batch_size, di.world_size)
    if rem or rows_per_rank % cfg.train.micro_batch_size:
        raise TrainingError(
            f"train.batch_size={cfg.train.batch_size} must split into {di.world_size} rank(s) × "
            f"micro-batches of train.micro_batch_size={cfg.train.micro_batch_size}. Fix: make the "
            f"batch a multiple of world_size × micro_batch_size."
        )
    accum = rows_per_rank // cfg.train.micro_batch_size
    if cfg.train.eval_batch_size % di.world_size:
        raise TrainingError(
            f"train.eval_batch_size={cfg.train.eval_batch_size} is not divisible by the "
            f"{di.world_size} ranks. Fix: make it a multiple of the world size."
        )
    loader = TokenLoader(data_dir, "train", cfg.train.seq_len, cfg.train.batch_size, rank=di.rank,
                         world_size=di.world_size, seed=cfg.seed)

    # Model: built on meta, block linears swapped for the scheme's, parallelized, then materialized.
    model = build_model(cfg.model, device="meta")
    scheme = scheme_from_config(cfg.quant)
    quant.quantize_model(model, scheme, skip=skip_patterns(cfg.quant, cfg.model.n_layer))
    n_params = model.num_params(non_embedding=True)
    flops_per_token = model.flops_per_token(cfg.train.seq_len)
    parallelize(model, di.mesh, activation_checkpointing=cfg.parallel.activation_checkpointing,
                ac_every=cfg.parallel.ac_every, compile=cfg.compile, compile_mode=cfg.compile_mode,
                bf16_params=autocast)
    graphs = replays_cuda_graphs(cfg.compile, cfg.compile_mode)
    materialize(model, device, cfg.seed)
    optimizer = build_adamw(model, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.eps)
    steps = total_steps(cfg, n_params)

    # Resume from the newest complete checkpoint of this run directory.
    resolved = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = config_fingerprint({**resolved, "world_size": di.world_size})
    checkpoints = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                               async_save=cfg.train.async_checkpoint, is_main=main_rank)
    start, run_id, last_val = 0, None, None
    latest = checkpoints.latest() if cfg.resume else None
    if latest is not None:
        saved = read_extra(latest)["fingerprint"]
        if cfg.parallel.allow_reshard:
            saved = {**saved, "world_size": fingerprint["world_size"]}
        check_fingerprint(saved, fingerprint, latest)
        extra = Checkpointer.load(latest, model, optimizer)
        loader.load_state_dict(extra["loader"])
        randomness.load_state_dict({**extra["quant_rng"], "rank": di.rank})
        torch.set_rng_state(extra["torch_rng"])
        start, run_id, last_val = extra["step"], extra["wandb_run_id"], extra.get("val_loss")
    barrier()

    tracker = (Tracker(run_dir, resolved, cfg.run_name, cfg.run_group, OmegaConf.to_container(cfg.wandb),
                       run_id, steps, start) if main_rank else NullTracker())
    tracker.info(
        f"run {cfg.run_name}: model {cfg.model.name} ({n_params:,} non-embedding params), scheme "
        f"{scheme.name}, {steps} steps of {cfg.train.batch_size}×{cfg.train.seq_len} tokens, "
        f"{di.world_size} rank(s) on {device.type}, dir {run_dir}"
        + (f"; resuming at step {start} from {latest}" if latest else "")
    )

    def save(step: int, force_sync: bool = False) -> Path:
        return checkpoints.save(step, model, optimizer, {
            "step": step, "loader": loader.state_dict(), "quant_rng": randomness.state_dict(),
            "torch_rng": torch.get_rng_state(), "wandb_run_id": tracker.run_id,
            "fingerprint": fingerprint, "config": resolved, "val_loss": last_val,
        }, force_sync=force_sync)

    peak = bf16_peak_flops(device, cfg.train.peak_flops)
    fsdp = di.mesh is not None
    model.train()
    t0, tokens_since = time.perf_counter(), 0
    exit_code = 0
    try:
        for step in range(start, steps):
            if any_rank(preemption.requested(), device):
                path = save(step, force_sync=True)
                if main_rank:
                    preemption.mark_requeue()
                tracker.info(f"stop requested: checkpointed step {step} to {path}; exiting for requeue")
                raise Preempted(step)
            lr = lr_at(step, steps, cfg.optim.lr, cfg.optim.warmup_frac, cfg.optim.start_ratio,
                       cfg.optim.final_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr

            inputs, targets = loader.next_batch()
            loss_sum = torch.zeros((), device=device)
            for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
                quant.set_quant_step(step, micro)
                if micro == 0 and graphs:
                    # Once per optimizer step: a later micro-step's replay would overwrite the
                    # graph outputs that the gradients being accumulated still are.
                    torch.compiler.cudagraph_mark_step_begin()
                if fsdp:
                    model.set_requires_gradient_sync(micro == accum - 1)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = model(x.to(device), y.to(device))
                (loss / accum).backward()
                loss_sum += loss.detach().float()
            train_loss = all_reduce_mean(loss_sum / accum).item()
            if not math.isfinite(train_loss):
                good = checkpoints.latest()
                raise TrainingError(
                    f"the training loss is {train_loss} at step {step + 1}. The run stopped without "
                    f"saving; the last good checkpoint is {good or 'none (no checkpoint yet)'}. "
                    f"Fix: lower optim.lr, check the data, or try quant=bf16 to see whether the "
                    f"quantization scheme is at fault; the run resumes from that checkpoint."
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_since += cfg.train.batch_size * cfg.train.seq_len
            tracker.advance()

            done = step + 1
            metrics: dict[str, Any] = {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": grad_norm.item()}
            if done % cfg.train.log_every == 0 or done == steps:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                tps = tokens_since / elapsed
                metrics |= {
                    "perf/tokens_per_s": tps,
                    "perf/tokens_per_s_per_rank": tps / di.world_size,
                    "perf/mfu_vs_bf16_peak": mfu(flops_per_token, tps / di.world_size, peak),
                    "perf/peak_memory_gib": peak_memory_gib(device),
                    "perf/eta_min": (steps - done) * cfg.train.batch_size * cfg.train.seq_len / tps / 60,
                }
                t0, tokens_since = time.perf_counter(), 0
            if done % cfg.train.eval_every == 0 or done == steps:
                last_val = evaluate(model, data_dir, cfg, di, autocast)
                metrics["val/loss"] = last_val
            tracker.log(done, metrics, line="perf/tokens_per_s" in metrics or "val/loss" in metrics)
            if done % cfg.train.ckpt_every == 0 or done == steps:
                save(done)

        checkpoints.wait()
        if last_val is None:
            last_val = evaluate(model, data_dir, cfg, di, autocast)
        summary = {"final_val_loss": last_val, "steps": steps, "tokens": steps * cfg.train.batch_size *
                   cfg.train.seq_len, "non_embedding_params": n_params, "scheme": scheme.name,
                   "model": cfg.model.name, "world_size": di.world_size}
        tracker.summary(summary)
        tracker.info(f"done: final validation loss {last_val:.4f} after {steps} steps ({run_dir})")
        return summary
    except Preempted:
        raise
    except BaseException:
        exit_code = 1
        raise
    finally:
        tracker.finish(exit_code)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Preempted:
        sys.exit(0)
    except (TrainingError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
