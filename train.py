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

import quant
from data.loader import TokenLoader, val_batches
from data.prepare import load_manifest, prepare_from_config
from data.tokenizer import check_vocab
from model import build_model
from quant import randomness
from training.checkpoint import Checkpointer, check_fingerprint, config_fingerprint
from training.metrics import bf16_peak_flops, mfu, peak_memory_gib
from training.optim import build_adamw
from training.schedule import lr_at
from training.tracking import Tracker


def _budget(steps: Any, tokens_per_param: Any) -> str:
    return f"{tokens_per_param}tpp" if tokens_per_param not in (None, "None", "null") else f"{steps}steps"


OmegaConf.register_new_resolver("budget", _budget, replace=True)


class TrainingError(RuntimeError):
    """A run stopped for a reason the user can act on; the message says what and how."""


def scheme_from_config(qcfg: DictConfig) -> quant.Scheme:
    return quant.get_scheme(
        qcfg.name,
        forward=qcfg.forward,
        backward=qcfg.backward,
        rotation=qcfg.rotation,
        four_over_six=qcfg.four_over_six,
        sr_four_over_six=qcfg.sr_four_over_six,
        delayed_amax=qcfg.delayed_amax,
    )


def skip_patterns(qcfg: DictConfig, n_layer: int) -> list[str]:
    patterns = list(qcfg.skip)
    if qcfg.get("keep_edge_blocks"):
        patterns += quant.edge_block_patterns(n_layer, qcfg.keep_edge_blocks.first, qcfg.keep_edge_blocks.last)
    return patterns


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device=cuda but no CUDA GPU is visible. Fix: device=cpu or device=auto.")
    return torch.device(name)


def total_steps(cfg: DictConfig, non_embedding_params: int) -> int:
    """The token budget in optimizer steps: ``train.steps``, or ``tokens_per_param × N`` tokens."""
    if cfg.train.tokens_per_param is not None:
        tokens = cfg.train.tokens_per_param * non_embedding_params
        return max(1, math.ceil(tokens / (cfg.train.batch_size * cfg.train.seq_len)))
    if not cfg.train.steps or cfg.train.steps < 1:
        raise TrainingError("set a token budget: train.steps=N or train.tokens_per_param=T")
    return int(cfg.train.steps)


@torch.no_grad()
def evaluate(model, data_dir: Path, cfg: DictConfig, device: torch.device, autocast: bool) -> float:
    """Mean validation loss over a fixed set of held-out batches."""
    model.eval()
    losses = []
    for x, y in val_batches(data_dir, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.eval_batches):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            losses.append(model(x.to(device), y.to(device)).float())
    model.train()
    return torch.stack(losses).mean().item()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics (also in ``run_dir/summary.json``)."""
    run_dir = Path(cfg.run_dir or hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    device = resolve_device(cfg.device)
    autocast = cfg.precision == "bf16"
    torch.manual_seed(cfg.seed)
    quant.set_quant_rng(seed=cfg.seed, rank=0)

    # Data: prepare the token shards if needed (bundled corpus by default).
    data_dir = prepare_from_config(cfg.data)
    check_vocab(load_manifest(data_dir)["vocab_size"], cfg.model.vocab_size)
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainingError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}. "
            f"Fix: lower train.seq_len or raise model.max_seq_len."
        )
    if cfg.train.batch_size % cfg.train.micro_batch_size:
        raise TrainingError(
            f"train.batch_size={cfg.train.batch_size} is not a multiple of train.micro_batch_size="
            f"{cfg.train.micro_batch_size}. Fix: choose a micro-batch that divides the batch."
        )
    accum = cfg.train.batch_size // cfg.train.micro_batch_size
    loader = TokenLoader(data_dir, "train", cfg.train.seq_len, cfg.train.batch_size, seed=cfg.seed)

    # Model: plain Llama, block linears swapped for the scheme's quantized ones.
    model = build_model(cfg.model, device=device)
    scheme = scheme_from_config(cfg.quant)
    quant.quantize_model(model, scheme, skip=skip_patterns(cfg.quant, cfg.model.n_layer))
    n_params = model.num_params(non_embedding=True)
    flops_per_token = model.flops_per_token(cfg.train.seq_len)
    step_fn_model = torch.compile(model) if cfg.compile else model
    optimizer = build_adamw(model, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.eps)
    steps = total_steps(cfg, n_params)

    # Resume from the newest complete checkpoint of this run directory.
    resolved = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = config_fingerprint(resolved)
    checkpoints = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    start, run_id, last_val = 0, None, None
    latest = checkpoints.latest() if cfg.resume else None
    if latest is not None:
        state = Checkpointer.load(latest)
        check_fingerprint(state["fingerprint"], fingerprint, latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        randomness.load_state_dict(state["quant_rng"])
        torch.set_rng_state(state["torch_rng"])
        start, run_id, last_val = state["step"], state["wandb_run_id"], state.get("val_loss")

    tracker = Tracker(run_dir, resolved, cfg.run_name, cfg.run_group, OmegaConf.to_container(cfg.wandb),
                      run_id, steps, start)
    tracker.info(
        f"run {cfg.run_name}: model {cfg.model.name} ({n_params:,} non-embedding params), scheme "
        f"{scheme.name}, {steps} steps of {cfg.train.batch_size}×{cfg.train.seq_len} tokens, device "
        f"{device}, dir {run_dir}" + (f"; resuming at step {start} from {latest}" if latest else "")
    )

    def save(step: int) -> Path:
        return checkpoints.save(step, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "loader": loader.state_dict(), "quant_rng": randomness.state_dict(),
            "torch_rng": torch.get_rng_state(), "wandb_run_id": tracker.run_id,
            "fingerprint": fingerprint, "config": resolved, "val_loss": last_val,
        })

    peak = bf16_peak_flops(device, cfg.train.peak_flops)
    model.train()
    t0, tokens_since = time.perf_counter(), 0
    exit_code = 0
    try:
        for step in range(start, steps):
            lr = lr_at(step, steps, cfg.optim.lr, cfg.optim.warmup_frac, cfg.optim.start_ratio,
                       cfg.optim.final_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr

            inputs, targets = loader.next_batch()
            loss_sum = torch.zeros((), device=device)
            for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
                quant.set_quant_step(step, micro)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = step_fn_model(x.to(device), y.to(device))
                (loss / accum).backward()
                loss_sum += loss.detach()
            train_loss = (loss_sum / accum).item()
            if not math.isfinite(train_loss):
                good = checkpoints.latest()
                raise TrainingError(
                    f"the training loss is {train_loss} at step {step}. The run stopped without "
                    f"saving; the last good checkpoint is {good or 'none (no checkpoint yet)'}. "
                    f"Fix: lower optim.lr, check the data, or try quant=bf16 to see whether the "
                    f"quantization scheme is at fault; the run resumes from that checkpoint."
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip).item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_since += cfg.train.batch_size * cfg.train.seq_len
            tracker.advance()

            done = step + 1
            metrics: dict[str, Any] = {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": grad_norm}
            if done % cfg.train.log_every == 0 or done == steps:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                tps = tokens_since / elapsed
                metrics |= {
                    "perf/tokens_per_s": tps,
                    "perf/mfu_vs_bf16_peak": mfu(flops_per_token, tps, peak),
                    "perf/peak_memory_gib": peak_memory_gib(device),
                    "perf/eta_min": (steps - done) * cfg.train.batch_size * cfg.train.seq_len / tps / 60,
                }
                t0, tokens_since = time.perf_counter(), 0
            if done % cfg.train.eval_every == 0 or done == steps:
                last_val = evaluate(model, data_dir, cfg, device, autocast)
                metrics["val/loss"] = last_val
            tracker.log(done, metrics, line="perf/tokens_per_s" in metrics or "val/loss" in metrics)
            if done % cfg.train.ckpt_every == 0 or done == steps:
                save(done)

        if last_val is None:
            last_val = evaluate(model, data_dir, cfg, device, autocast)
        summary = {"final_val_loss": last_val, "steps": steps, "tokens": steps * cfg.train.batch_size *
                   cfg.train.seq_len, "non_embedding_params": n_params, "scheme": scheme.name,
                   "model": cfg.model.name}
        tracker.summary(summary)
        tracker.info(f"done: final validation loss {last_val:.4f} after {steps} steps ({run_dir})")
        return summary
    except BaseException:
        exit_code = 1
        raise
    finally:
        tracker.finish(exit_code)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (TrainingError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
