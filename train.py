"""Pre-train a Llama model whose block linears run in NVFP4 (or BF16).

    python train.py                                   # tiny model, quartet2, bundled corpus, CPU is fine
    python train.py quant=nvidia model=30m train.tokens_per_param=100
    python train.py quant=quartet2 model=1.9b data=c4 data.tokenizer_path=/path/to/tokenizer.model

The loop, top to bottom: check the settings; resume from the newest checkpoint of the run
directory that verifies, or start fresh (an earlier run there is moved aside); build data, model
and optimizer; then, for every optimizer step, act on a stop request (preemption or Ctrl-C:
checkpoint and exit), set the learning rate, run the micro-batches (forward under BF16 autocast,
backward), clip, step, stop on a non-finite loss, gradient norm or parameter, log, validate and
checkpoint. The loop never waits for the GPU between those: each step's loss, gradient norm and
max |p| stay on the device until a log, validation or checkpoint step reads them all at once
(training/step.py runs the step, on one GPU as one replayed CUDA graph). A quantized run logs its
validation loss gap to its bf16 baseline (training/baseline.py). Configs live in configs/
(Hydra); see README.md, docs/reliability.md and docs/performance.md.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Stop requests (SIGTERM, SIGUSR1, Ctrl-C) that arrive while torch imports are recorded, not
    # lost: the handlers go in before anything heavy is imported (training/preemption.py).
    from training.preemption import install_early

    install_early()

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import quant
from data.loader import TokenLoader, val_batches
from data.prepare import load_manifest, prepare_from_config
from data.tokenizer import check_vocab
from model import build_model
from model.parallel import materialize, parallelize, replays_cuda_graphs
from quant import backend as quant_backend
from quant import randomness
from training import downstream
from training.baseline import CONFIG_FILE, BaselineError, LiveGap
from training.checkpoint import Checkpointer, CheckpointError, check_fingerprint, config_fingerprint, read_extra
from training.config_checks import check_train_config
from training.distributed import AnyRankLagged, DistInfo, all_reduce_mean, barrier, init_distributed, shutdown
from training.health import first_nonfinite
from training.metrics import bf16_peak_flops, mfu, peak_memory_gib
from training.optim import build_adamw
from training.preemption import STOP_FILE, PreemptionWatcher
from training.run_dir import holds_a_run, move_aside, read_metrics, rewind_metrics
from training.schedule import lr_at
from training.step import TrainStep, graph_blocker
from training.tracking import NullTracker, Tracker


def _budget(steps: Any, tokens_per_param: Any) -> str:
    return f"{tokens_per_param}tpp" if tokens_per_param not in (None, "None", "null") else f"{steps}steps"


def _scheme_label(quant_cfg: Any) -> str:
    """The quant config's scheme name, then ``+key=value`` for each ablation switch
    (:data:`quant.ABLATIONS`) that changes the scheme on its own: two ablations of one scheme get
    two run names, and a switch set to what the scheme already does (``four_over_six=true`` on
    quartet2) changes nothing."""
    name = str(quant_cfg["name"])
    if name not in quant.SCHEMES:
        return name  # the trainer refuses it, naming the schemes
    label, plain = name, quant.get_scheme(name)
    for key, default in quant.ABLATIONS.items():
        value = quant_cfg.get(key, default)
        if value == default:
            continue
        try:
            changes = quant.get_scheme(name, **{key: value}) != plain
        except ValueError:  # valid only with other switches: it changes the scheme
            changes = True
        if changes:
            label += f"+{key}={value}"  # analysis.runs.RUN_NAME reads it back as the report's label
    return label


OmegaConf.register_new_resolver("budget", _budget, replace=True)
OmegaConf.register_new_resolver("scheme_label", _scheme_label, replace=True)


class TrainingError(RuntimeError):
    """A run stopped for a reason the user can act on; the message says what and how."""


class Preempted(Exception):
    """The run checkpointed on a preemption request and exits so that Slurm can requeue it."""


class Interrupted(Exception):
    """The run checkpointed on Ctrl-C and stops; the message says how to resume."""


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


def _tokens(n: int) -> str:
    """A token count for a log line: 6.14k, 762M, 38B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def run_dir_of(cfg: DictConfig) -> Path:
    """``cfg.run_dir``, or Hydra's output directory (``${run_root}/${run_name}``)."""
    return Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)


def command_line(*extra: str) -> str:
    """The command that started this run (Hydra's overrides), with ``extra`` overrides replacing
    those of the same keys; generic when the run was not started from the command line."""
    keys = {e.split("=", 1)[0] for e in extra}
    try:
        given = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") not in keys]
    except ValueError:  # no Hydra run: train.run(cfg) called from code
        return "python train.py <the same overrides> " + " ".join(shlex.quote(e) for e in extra)
    return " ".join(["python train.py", *(shlex.quote(o) for o in [*given, *extra])])


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


def run(cfg: DictConfig, handle_ctrl_c: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics (also in ``run_dir/summary.json``).

    Works in one process or under torchrun/srun (FSDP2 over all ranks, see model/parallel.py).
    ``handle_ctrl_c``: the first Ctrl-C checkpoints and raises :class:`Interrupted` (the command
    line's behaviour); otherwise Ctrl-C stays the caller's.
    """
    dist_info = init_distributed(cfg.device, cfg.parallel.replicate, timeout_s=cfg.parallel.timeout_s,
                                 shard_alone=cfg.parallel.fsdp is True)
    try:
        summary = _train(cfg, dist_info, handle_ctrl_c)
        barrier()  # every rank is done before any tears the process group down
        return summary
    finally:
        shutdown()


def _train(cfg: DictConfig, di: DistInfo, handle_ctrl_c: bool = False) -> dict[str, Any]:
    """Check the settings, decide between resuming and a fresh start (which moves an earlier
    run in the same directory aside), watch for stop requests, then train."""
    check_train_config(cfg, di.world_size)
    run_dir = run_dir_of(cfg)
    checkpoints = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                               async_save=cfg.train.async_checkpoint, is_main=di.is_main)
    notes: list[str] = []
    latest, skipped = checkpoints.newest_verified(clean=True) if cfg.resume else (None, [])
    for path, why in skipped:
        notes.append(f"warning: skipped checkpoint {path}: {why}")
    if latest is None and di.is_main and holds_a_run(run_dir):
        aside = move_aside(run_dir, keep=(".hydra", STOP_FILE))
        why = ("resume=false" if not cfg.resume else
               "no checkpoint of it verifies" if skipped else "it has no checkpoint")
        notes.append(f"starting from step 0 ({why}): the earlier run in {run_dir} was moved to {aside}")
    if di.is_main:  # what a quantized run looks for in its bf16 baseline (training/baseline.py)
        text = json.dumps(OmegaConf.to_container(cfg, resolve=True), default=str)
        path = run_dir / CONFIG_FILE
        if not path.is_file() or path.read_text() != text:  # a finished run started again writes nothing
            run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    barrier()
    preemption = PreemptionWatcher(run_dir, interrupt_signal=handle_ctrl_c)
    if di.is_main:
        preemption.clear_requeue()
    preemption.start_watchdog(cfg.parallel.stop_grace_s)
    try:
        return _train_run(cfg, di, run_dir, checkpoints, latest, notes, preemption)
    finally:
        preemption.close()


def _train_run(cfg: DictConfig, di: DistInfo, run_dir: Path, checkpoints: Checkpointer, latest: Path | None,
               notes: list[str], preemption: PreemptionWatcher) -> dict[str, Any]:
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
    try:  # the validation set is checked now, not at the first validation hundreds of steps later
        val_batches(data_dir, cfg.train.seq_len, cfg.train.eval_batch_size, cfg.train.eval_batches,
                    rank=di.rank, world_size=di.world_size)
    except ValueError as err:
        raise TrainingError(f"train.eval_batches={cfg.train.eval_batches} × train.eval_batch_size="
                            f"{cfg.train.eval_batch_size}: {err}") from err
    downstream_every = cfg.train.downstream_eval_every
    if downstream_every:  # unknown tasks are found now, before any training
        try:
            downstream.check_config(cfg)
        except (ValueError, ImportError) as err:
            raise TrainingError(str(err)) from err
    accum = cfg.train.batch_size // di.world_size // cfg.train.micro_batch_size
    loader = TokenLoader(data_dir, "train", cfg.train.seq_len, cfg.train.batch_size, rank=di.rank,
                         world_size=di.world_size, seed=cfg.seed)

    # Model: built on meta, block linears swapped for the scheme's, parallelized, then materialized.
    model = build_model(cfg.model, device="meta")
    scheme = quant.scheme_from_config(cfg.quant)
    if cfg.kernels:  # imported only when asked for: the kernels' module loads triton
        from quant.kernels import set_tuning, tuning_from_mapping

        set_tuning(tuning_from_mapping(cfg.kernels))
    quant.quantize_model(model, scheme, skip=skip_patterns(cfg.quant, cfg.model.n_layer))
    if not scheme.is_identity:  # before any training: NVFP4_BACKEND=native off Blackwell stops here
        try:
            notes.append(quant_backend.describe(device))
        except RuntimeError as err:
            raise TrainingError(str(err)) from err
    n_params = model.num_params(non_embedding=True)
    flops_per_token = model.flops_per_token(cfg.train.seq_len)
    steps = total_steps(cfg, n_params)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len

    # Resume from the newest checkpoint that verifies (found by _train), unless the run is done.
    resolved = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = config_fingerprint({**resolved, "world_size": di.world_size})
    start, run_id, last_val, extra = 0, None, None, None
    if latest is not None:
        extra = read_extra(latest)
        saved = extra["fingerprint"]
        if cfg.parallel.allow_reshard:
            saved = {**saved, "world_size": fingerprint["world_size"]}
        for key, (old, new) in check_fingerprint(saved, fingerprint, latest, cfg.resume_with_changes).items():
            notes.append(f"resuming with a changed setting (resume_with_changes): {key} {old!r} → {new!r}")
        if extra["step"] >= steps and (run_dir / "summary.json").is_file():
            return _already_finished(run_dir, steps, main_rank)

    parallelize(model, di.mesh, activation_checkpointing=cfg.parallel.activation_checkpointing,
                ac_every=cfg.parallel.ac_every, compile=cfg.compile, compile_mode=cfg.compile_mode,
                bf16_params=autocast)
    materialize(model, device, cfg.seed)
    optimizer = build_adamw(model, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.eps)
    if extra is not None:
        extra = Checkpointer.load(latest, model, optimizer)
        loader.load_state_dict(extra["loader"])
        randomness.load_state_dict({**extra["quant_rng"], "rank": di.rank})
        torch.set_rng_state(extra["torch_rng"])
        start, run_id, last_val = extra["step"], extra["wandb_run_id"], extra.get("val_loss")
        if main_rank and (moved := rewind_metrics(run_dir, start)):
            notes.append(f"{moved} metrics row(s) after step {start}, which this run replays, were moved "
                         f"to {run_dir / 'metrics.replaced.jsonl'}")
    barrier()

    tracker = (Tracker(run_dir, resolved, cfg.run_name, cfg.run_group, OmegaConf.to_container(cfg.wandb),
                       run_id, steps, start) if main_rank else NullTracker())
    tracker.info(
        f"run {cfg.run_name}: model {cfg.model.name} ({n_params:,} non-embedding params), scheme "
        f"{scheme.name}, {steps} steps of {cfg.train.batch_size}×{cfg.train.seq_len} tokens "
        f"({_tokens(steps * tokens_per_step)} tokens), {di.world_size} rank(s) on {device.type}; "
        + (f"resuming at step {start} from {latest}" if latest else "starting from step 0")
        + f"; dir {run_dir}"
    )
    gaps = None
    if main_rank:
        try:
            gaps = LiveGap(resolved, run_dir, tracker.wandb_project)
        except BaselineError as err:
            tracker.finish(1)
            raise TrainingError(str(err)) from err
        if start:
            gaps.resume(read_metrics(run_dir))
    for note in ([gaps.line] if gaps else []) + (
            [tracker.wandb_note] if getattr(tracker, "wandb_note", None) else []) + notes:
        tracker.info(note)

    def with_gap(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` of a validation step, with a loss gap when one is ready to log."""
        if gaps is None:
            return metrics
        row, found = gaps.at_validation(step, metrics["val/loss"])
        if found:
            tracker.info(found)
        return metrics | row

    def save(step: int, force_sync: bool = False) -> Path:
        try:
            saved = checkpoints.save(step, model, optimizer, {
                "step": step, "loader": loader.state_dict(), "quant_rng": randomness.state_dict(),
                "torch_rng": torch.get_rng_state(), "wandb_run_id": tracker.run_id,
                "fingerprint": fingerprint, "config": resolved, "val_loss": last_val,
            }, force_sync=force_sync)
        except CheckpointError as err:
            raise TrainingError(str(err)) from err
        if saved.nbytes == 0:
            tracker.info(f"step {step}: already checkpointed in {saved.path}")
        else:
            how = "started in the background" if cfg.train.async_checkpoint and not force_sync else "saved"
            tracker.info(f"step {step}: checkpoint of {saved.nbytes / 2**20:,.1f} MiB {how} in "
                         f"{saved.seconds:.1f} s: {saved.path}")
        return saved.path

    def stop(step: int) -> None:
        """Act on a stop request at the boundary before ``step``: checkpoint (unless nothing is
        trained yet), then raise Preempted (requeue) or Interrupted (Ctrl-C)."""
        preemption.acknowledge()
        reason = preemption.preempt_reason()
        path = save(step, force_sync=True) if step > 0 else None
        if reason is not None:
            if main_rank:
                preemption.mark_requeue()
            tracker.info(f"stop requested ({reason}): "
                         + (f"checkpointed step {step} to {path}" if path else "nothing trained yet")
                         + "; exiting for requeue")
            raise Preempted(step)
        raise Interrupted(
            f"stopped by Ctrl-C before step {step + 1}: "
            + (f"checkpointed step {step} to {path}" if path else "nothing was trained yet")
            + f". Resume with the same command: {command_line()}"
        )

    def stopped_on(step: int, problem: str) -> TrainingError:
        good, _ = checkpoints.newest_verified()
        changes = sorted({*cfg.resume_with_changes, "optim.lr"})
        lower = [f"optim.lr={cfg.optim.lr / 2:g}"]
        if good is not None:
            lower.append(f"resume_with_changes=[{','.join(changes)}]")
        return TrainingError(
            f"{problem} at step {step + 1}. The run stopped before saving or logging that step; the "
            f"newest good checkpoint is {good or 'none (no checkpoint yet)'}. Fix: "
            + (f"resume from it with half the learning rate: {command_line(*lower)}" if good else
               f"start again with half the learning rate: {command_line(*lower)}")
            + "; or check the data, or try quant=bf16 to see whether the quantization scheme is at fault."
        )

    peak = bf16_peak_flops(device, cfg.train.peak_flops)
    fsdp = di.mesh is not None
    blocker = graph_blocker(device, fsdp, cfg.compile_mode if cfg.compile else "default", scheme.name)
    if cfg.cuda_graph is True and blocker:
        raise TrainingError(f"cuda_graph=true, but the step cannot be one CUDA graph here: {blocker}. "
                            f"Fix: cuda_graph=auto (or false).")
    if cfg.cuda_graph == "auto" and blocker is None and not cfg.compile:
        blocker = "compile=false (cuda_graph=auto captures compiled steps; cuda_graph=true forces it)"
    use_graph = cfg.cuda_graph is True or (cfg.cuda_graph == "auto" and blocker is None)
    if cfg.cuda_graph == "auto" and device.type == "cuda":
        tracker.info("each step replays as one CUDA graph (cuda_graph=auto)" if use_graph else
                     f"steps run without a CUDA graph: {blocker}")
    train_step = TrainStep(model, optimizer, accum=accum, device=device, autocast=autocast,
                           grad_clip=cfg.optim.grad_clip, fsdp=fsdp, cuda_graph=use_graph,
                           block_graphs=replays_cuda_graphs(cfg.compile, cfg.compile_mode))
    stop_poll = AnyRankLagged(device)
    # Steps run but not yet read: (step, lr, health [loss, grad norm, max |p|] on the device).
    unread: list[tuple[int, float, torch.Tensor]] = []

    def read_health() -> list[dict[str, Any]]:
        """The metrics of the unread steps (one wait for the GPU); a non-finite loss, gradient
        norm or parameter stops the run at the first step that has one, before it or any later
        step is logged or saved."""
        if not unread:
            return []
        values = torch.stack([h for _, _, h in unread]).tolist()
        rows = []
        for (step, lr, _), (train_loss, norm, param_max) in zip(unread, values):
            if problem := first_nonfinite(train_loss, norm, param_max):
                raise stopped_on(step, problem)
            rows.append({"train/loss": train_loss, "train/lr": lr, "train/grad_norm": norm})
        tracker.advance(len(rows))
        first = unread[0][0]
        unread.clear()
        for i, row in enumerate(rows[:-1]):
            tracker.log(first + i + 1, row, line=False)
        return rows

    model.train()
    exit_code = 0
    t_run = time.perf_counter()
    try:
        if start == 0:  # the loss at initialisation: ln(vocab) for a well-initialised model
            last_val = evaluate(model, data_dir, cfg, di, autocast)
            tracker.log(0, with_gap(0, {"val/loss": last_val}), line=False)
            tracker.info(f"step 0: validation loss {last_val:.4f}")
        t0, tokens_since = time.perf_counter(), 0
        for step in range(start, steps):
            if stop_poll.poll(preemption.requested()):
                if rows := read_health():
                    tracker.log(step, rows[-1], line=False)
                stop(step)
            lr = lr_at(step, steps, cfg.optim.lr, cfg.optim.warmup_frac, cfg.optim.start_ratio,
                       cfg.optim.final_ratio)
            inputs, targets = loader.next_batch()
            unread.append((step, lr, train_step(step, inputs, targets, lr)))
            tokens_since += tokens_per_step

            done = step + 1
            log_now = done % cfg.train.log_every == 0 or done == steps
            eval_now = done % cfg.train.eval_every == 0 or done == steps
            save_now = done % cfg.train.ckpt_every == 0 or done == steps
            downstream_now = bool(downstream_every) and (done % downstream_every == 0 or done == steps)
            if not (log_now or eval_now or save_now or downstream_now):
                continue
            metrics: dict[str, Any] = read_health()[-1]
            if log_now:
                elapsed = time.perf_counter() - t0  # read_health waited for the GPU
                tps = tokens_since / elapsed
                metrics |= {
                    "perf/tokens_per_s": tps,
                    "perf/tokens_per_s_per_rank": tps / di.world_size,
                    "perf/mfu_vs_bf16_peak": mfu(flops_per_token, tps / di.world_size, peak),
                    "perf/peak_memory_gib": peak_memory_gib(device),
                    "perf/eta_min": (steps - done) * tokens_per_step / tps / 60,
                }
            if eval_now:
                last_val = evaluate(model, data_dir, cfg, di, autocast)
                metrics = with_gap(done, metrics | {"val/loss": last_val})
            if downstream_now:
                metrics |= downstream.during_training(model, cfg, data_dir, main_rank, device)
            tracker.log(done, metrics, line=log_now or eval_now or downstream_now)
            if eval_now:
                tracker.info(f"step {done}: validation loss {last_val:.4f}")
            if save_now:
                save(done)
            if log_now:
                t0, tokens_since = time.perf_counter(), 0

        try:
            checkpoints.wait()
        except CheckpointError as err:
            raise TrainingError(str(err)) from err
        summary = {"final_val_loss": last_val, "steps": steps, "tokens": steps * tokens_per_step,
                   "non_embedding_params": n_params, "scheme": scheme.name,
                   "model": cfg.model.name, "world_size": di.world_size}
        if gaps is not None and gaps.active:
            tracker.log_after(steps, gaps.remaining())
            if (final_gap := gaps.final(steps)) is not None:
                summary |= {"loss_gap": final_gap, "loss_gap_baseline": gaps.baseline.where}
            if missing := gaps.missing():
                tracker.info(f"loss gap: the baseline has no validation loss yet at step(s) {missing}; "
                             f"`python scripts/compare_runs.py {run_dir.parent}` reports them once it has")
            elif final_gap is not None:
                tracker.info(f"loss gap at step {steps}: {summary['loss_gap']:+.4f} against "
                             f"{gaps.baseline.where}")
        tracker.summary(summary)
        minutes = (time.perf_counter() - t_run) / 60
        tracker.info(f"done: final validation loss {last_val:.4f} after {steps} steps "
                     f"({_tokens(steps * tokens_per_step)} tokens), {minutes:.1f} min"
                     + (f" since resuming at step {start}" if start else "") + "; "
                     f"results in {run_dir}")
        return summary
    except (Preempted, Interrupted):
        raise
    except BaseException:
        exit_code = 1
        raise
    finally:
        tracker.finish(exit_code)


def _already_finished(run_dir: Path, steps: int, main_rank: bool) -> dict[str, Any]:
    """A finished run started again: say so, write nothing, return its summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if main_rank:
        print(f"run {run_dir} is already finished ({steps} of {steps} steps, final validation loss "
              f"{summary.get('final_val_loss', float('nan')):.4f}); nothing to do. Results: "
              f"{run_dir / 'summary.json'}, {run_dir / 'metrics.jsonl'}. To train it again from step "
              f"0: resume=false (the finished run is moved aside).", flush=True)
    return summary


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, handle_ctrl_c=True)
    except Preempted:
        sys.exit(0)
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print(f"\nstopped at once (second Ctrl-C), without saving. Resume from the newest checkpoint "
              f"in {run_dir_of(cfg) / 'checkpoints'} with the same command: {command_line()}", file=sys.stderr)
        sys.exit(130)
    except (TrainingError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
