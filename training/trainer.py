"""The trainer: build a run, then loop over its optimizer steps.

:func:`run` trains as a config says, in one process or under torchrun/srun (FSDP2 over all ranks,
model/parallel.py). :func:`train` checks the settings and opens the run directory: it resumes from
the newest checkpoint there that verifies, or starts fresh (an earlier run there is moved aside).
:class:`Trainer` then

* builds (:meth:`Trainer.__init__`, :meth:`Trainer._materialize`): the token shards (rank 0
  prepares them, the bundled corpus by default), the loader and the held-out set; the model on
  the meta device with the scheme's block linears; the token budget and the checkpoint's
  fingerprint check; then the parallelized, materialized model, AdamW and the resumed state
  (:class:`training.checkpoint.TrainState`);
* loops (:meth:`Trainer._loop`): for every optimizer step, act on a stop request (preemption or
  Ctrl-C: checkpoint and exit, :mod:`training.stopping`), set the learning rate, run the step
  (:mod:`training.step`: the micro-batches under BF16 autocast, clipping, AdamW; on one GPU one
  replayed CUDA graph), then log, validate (:mod:`training.validation`: the loss, its gap to the
  bf16 baseline, downstream tasks) and checkpoint when due.

The loop never waits for the GPU between those: each step's loss, gradient norm and max |p| stay
on the device until a log, validation or checkpoint step reads them all at once, and a non-finite
one stops the run before that step is saved or logged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import quant
from data.loader import TokenLoader
from data.prepare import load_manifest, prepare_from_config
from data.tokenizer import check_vocab
from model import build_model
from model.parallel import materialize, parallelize, replays_cuda_graphs
from quant import backend as quant_backend
from quant.recipe import quantize_with_recipe, recipe_from_config, set_precision

from .checkpoint import Checkpointer, CheckpointError, TrainState, check_fingerprint, config_fingerprint, read_extra
from .config_checks import check_train_config
from .cpu_kernels import describe as describe_cpu_kernels
from .cpu_kernels import resolve_precision
from .distributed import AnyRankLagged, DistInfo, barrier, init_distributed, shutdown
from .errors import Interrupted, Preempted, TrainingError
from .identity import total_steps
from .optim import build_adamw, lr_at
from .precision_schedule import switch_from_config
from .preemption import STOP_FILE, PreemptionWatcher
from .run_dir import holds_a_run, move_aside, read_metrics, record_command, rewind_metrics
from .step import NonFinite, PendingHealth, TrainStep, choose_cuda_graph
from .stopping import Stops
from .tracking import NullTracker, Throughput, Tracker
from .validation import Downstream, Validation


def tokens_text(n: int) -> str:
    """A token count for a log line: 6.14k, 762M, 38B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def run_dir_of(cfg: DictConfig) -> Path:
    """``cfg.run_dir``, or Hydra's output directory (``${run_root}/${run_name}``)."""
    return Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, handle_ctrl_c: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics (also in ``run_dir/summary.json``).

    Works in one process or under torchrun/srun (FSDP2 over all ranks, see model/parallel.py).
    ``handle_ctrl_c``: the first Ctrl-C checkpoints and raises :class:`Interrupted` (the command
    line's behaviour); otherwise Ctrl-C stays the caller's.
    """
    dist_info = init_distributed(cfg.device, cfg.parallel.replicate, timeout_s=cfg.parallel.timeout_s,
                                 shard_alone=cfg.parallel.fsdp is True)
    try:
        summary = train(cfg, dist_info, handle_ctrl_c)
        barrier()  # every rank is done before any tears the process group down
        return summary
    finally:
        shutdown()


def _open_run_dir(run_dir: Path, checkpoints: Checkpointer, resume: bool,
                  is_main: bool) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (None: a fresh start, which moves an earlier run in
    ``run_dir`` aside), and the lines that say what was skipped or moved."""
    notes: list[str] = []
    latest, skipped = checkpoints.newest_verified(clean=True) if resume else (None, [])
    for path, why in skipped:
        notes.append(f"warning: skipped checkpoint {path}: {why}")
    if latest is None and is_main and holds_a_run(run_dir):
        aside = move_aside(run_dir, keep=(STOP_FILE,))
        why = "resume=false" if not resume else "no checkpoint of it verifies" if skipped else "it has no checkpoint"
        notes.append(f"starting from step 0 ({why}): the earlier run in {run_dir} was moved to {aside}")
    return latest, notes


def train(cfg: DictConfig, di: DistInfo, handle_ctrl_c: bool = False) -> dict[str, Any]:
    """Check the settings, decide between resuming and a fresh start, watch for stop requests,
    then build the :class:`Trainer` and train."""
    check_train_config(cfg, di.world_size)
    cfg.precision = resolve_precision(cfg.precision, di.device.type)  # the fingerprint holds what ran
    run_dir = run_dir_of(cfg)
    checkpoints = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                               async_save=cfg.train.async_checkpoint, is_main=di.is_main)
    latest, notes = _open_run_dir(run_dir, checkpoints, cfg.resume, di.is_main)
    barrier()
    preemption = PreemptionWatcher(run_dir, interrupt_signal=handle_ctrl_c)
    if di.is_main:
        preemption.clear_requeue()
    preemption.start_watchdog(cfg.parallel.stop_grace_s)
    try:
        return Trainer(cfg, di, run_dir, checkpoints, latest, notes, preemption).fit()
    finally:
        preemption.close()


class Trainer:
    """One run, built from ``cfg`` (see the module docstring). ``latest``: the checkpoint to
    resume from; ``notes``: lines to print once the run's log is open."""

    def __init__(self, cfg: DictConfig, di: DistInfo, run_dir: Path, checkpoints: Checkpointer,
                 latest: Path | None, notes: list[str], preemption: PreemptionWatcher) -> None:
        self.cfg, self.di, self.run_dir, self.checkpoints = cfg, di, run_dir, checkpoints
        self.latest, self.notes, self.preemption = latest, notes, preemption
        self.autocast = cfg.precision == "bf16"
        cpu_kernels = describe_cpu_kernels(di.device.type)
        if cpu_kernels:
            self.notes.append(cpu_kernels)
        torch.manual_seed(cfg.seed)
        quant.set_quant_rng(seed=cfg.seed, rank=di.rank)
        self.data_dir = self._prepare_data()
        t = cfg.train
        self.validation = Validation(
            self.data_dir, di, seq_len=t.seq_len, batch_size=t.eval_batch_size, batches=t.eval_batches,
            autocast=self.autocast, compile=cfg.compile, compile_mode=cfg.compile_mode,
            downstream=Downstream(t.downstream_eval_every, tuple(t.downstream_tasks or ()),
                                  t.downstream_include_path, t.downstream_limit),
            model_cfg=cfg.model, tokenizer_path=cfg.data.get("tokenizer_path"), bf16=t.eval_bf16)
        self.accum = t.batch_size // di.world_size // t.micro_batch_size
        loader = TokenLoader(self.data_dir, "train", t.seq_len, t.batch_size, rank=di.rank,
                             world_size=di.world_size, seed=cfg.seed)
        self.model, self.scheme = self._build_model()
        self.n_params = self.model.num_params(non_embedding=True)
        self.steps = total_steps(cfg, self.n_params)
        self.switch = switch_from_config(cfg.quant, self.steps)
        self.switched = False  # whether the quantized linears have switched (quant.schedule)
        self.tokens_per_step = t.batch_size * t.seq_len
        self.resolved = OmegaConf.to_container(cfg, resolve=True)
        fingerprint = config_fingerprint({**self.resolved, "world_size": di.world_size})
        self.state = TrainState(step=0, loader=loader, fingerprint=fingerprint, config=self.resolved)
        self.saved_step = self._check_resume(fingerprint)

    def _prepare_data(self) -> Path:
        """Rank 0 prepares the token shards if needed, then the other ranks find them."""
        if self.di.is_main:
            data_dir = prepare_from_config(self.cfg.data)
        barrier()
        if not self.di.is_main:
            data_dir = prepare_from_config(self.cfg.data)
        check_vocab(load_manifest(data_dir)["vocab_size"], self.cfg.model.vocab_size)
        return data_dir

    def _build_model(self) -> tuple[torch.nn.Module, quant.Scheme]:
        """The model on the meta device, its linears swapped as the scheme and its precision
        recipe say (:mod:`quant.recipe`: ``skip``, ``keep_edge_blocks``, ``bf16_tail``, ``recipe``)."""
        cfg = self.cfg
        model = build_model(cfg.model, device="meta")
        scheme = quant.scheme_from_config(cfg.quant)
        if cfg.kernels:  # imported only when asked for: the kernels' module loads triton
            from quant.kernels import set_tuning, tuning_from_mapping

            set_tuning(tuning_from_mapping(cfg.kernels))
        quantize_with_recipe(model, scheme, recipe_from_config(cfg.quant, cfg.model.n_layer, scheme.skip))
        if not scheme.is_identity:  # before any training: NVFP4_BACKEND=native off Blackwell stops here
            try:
                self.notes.append(quant_backend.describe(self.di.device))
            except RuntimeError as err:
                raise TrainingError(str(err)) from err
        return model, scheme

    def _check_resume(self, fingerprint: dict[str, Any]) -> int | None:
        """The step of the checkpoint to resume from, after its fingerprint is checked (None for
        a fresh start)."""
        if self.latest is None:
            return None
        extra = read_extra(self.latest)
        saved = extra["fingerprint"]
        if self.cfg.parallel.allow_reshard:
            saved = {**saved, "world_size": fingerprint["world_size"]}
        for key, (old, new) in check_fingerprint(saved, fingerprint, self.latest, self.cfg.resume_with_changes).items():
            self.notes.append(f"resuming with a changed setting (resume_with_changes): {key} {old!r} → {new!r}")
        return extra["step"]

    @property
    def finished(self) -> bool:
        """The run resumes at its last step with a summary: nothing is left to do."""
        done = self.saved_step is not None and self.saved_step >= self.steps
        return done and (self.run_dir / "summary.json").is_file()

    def fit(self) -> dict[str, Any]:
        """Train to the end of the budget (or to a stop); returns the summary."""
        if self.finished:
            return already_finished(self.run_dir, self.steps, self.di.is_main)
        cfg, di = self.cfg, self.di
        self.use_graph, graph_line = choose_cuda_graph(cfg.cuda_graph, di.device, di.mesh is not None, cfg.compile,
                                                       cfg.compile_mode, self.scheme.name)
        if di.is_main:  # every check has passed: the run trains, and its directory says with what
            record_command(self.run_dir, cfg, self.resolved)
        self._materialize()
        self._start_tracking()
        if graph_line:
            self.tracker.info(graph_line)
        self._build_step()
        return self._loop()

    def _materialize(self) -> None:
        """Parallelize and materialize the model, build AdamW, and restore a checkpoint's state."""
        cfg, di, model = self.cfg, self.di, self.model
        p = cfg.parallel
        self.notes += parallelize(model, di.mesh, activation_checkpointing=p.activation_checkpointing,
                                  ac_every=p.ac_every, compile=cfg.compile, compile_mode=cfg.compile_mode,
                                  bf16_params=self.autocast, weight_gather=p.weight_gather)
        materialize(model, di.device, cfg.seed)
        o = cfg.optim
        self.optimizer = build_adamw(model, o.lr, o.betas, o.weight_decay, o.eps)
        if self.latest is not None:
            self.state.restore(Checkpointer.load(self.latest, model, self.optimizer), di.rank)
            start = self.state.step
            if di.is_main and (moved := rewind_metrics(self.run_dir, start)):
                self.notes.append(f"{moved} metrics row(s) after step {start}, which this run replays, were moved "
                                  f"to {self.run_dir / 'metrics.replaced.jsonl'}")
        barrier()

    def _start_tracking(self) -> None:
        """Open the run's log, metrics and W&B run; say what runs and what the loss gap is against."""
        cfg, di, start = self.cfg, self.di, self.state.step
        self.tracker = (Tracker(self.run_dir, self.resolved, cfg.run_name, cfg.run_group,
                                OmegaConf.to_container(cfg.wandb), self.state.wandb_run_id, self.steps, start)
                        if di.is_main else NullTracker())
        self.state.wandb_run_id = self.tracker.run_id
        self.tracker.info(
            f"run {cfg.run_name}: model {cfg.model.name} ({self.n_params:,} non-embedding params), scheme "
            f"{self.scheme.name}, {self.steps} steps of {cfg.train.batch_size}×{cfg.train.seq_len} tokens "
            f"({tokens_text(self.steps * self.tokens_per_step)} tokens), {di.world_size} rank(s) on {di.device.type}; "
            + (f"resuming at step {start} from {self.latest}" if self.latest else "starting from step 0")
            + f"; dir {self.run_dir}"
        )
        lines = []
        if di.is_main:
            try:
                lines.append(self.validation.track_gap(self.resolved, self.run_dir, self.tracker.wandb_project,
                                                       read_metrics(self.run_dir) if start else None))
            except TrainingError:
                self.tracker.finish(1)
                raise
        if getattr(self.tracker, "wandb_note", None):
            lines.append(self.tracker.wandb_note)
        for line in lines + self.notes:
            self.tracker.info(line)

    def _build_step(self) -> None:
        """The optimizer step (one CUDA graph where it can be), the throughput meter and the stops."""
        cfg, di = self.cfg, self.di
        self.train_step = TrainStep(self.model, self.optimizer, accum=self.accum, device=di.device,
                                    autocast=self.autocast, grad_clip=cfg.optim.grad_clip, fsdp=di.mesh is not None,
                                    cuda_graph=self.use_graph,
                                    block_graphs=replays_cuda_graphs(cfg.compile, cfg.compile_mode))
        self.throughput = Throughput(di.device, self.model.flops_per_token(cfg.train.seq_len), di.world_size,
                                     self.tokens_per_step, cfg.train.peak_flops)
        self.health = PendingHealth()
        self.stop_poll = AnyRankLagged(di.device)
        self.stops = Stops(self.preemption, self.checkpoints, is_main=di.is_main, save=self._save,
                           say=self.tracker.info, lr=cfg.optim.lr, resume_with_changes=cfg.resume_with_changes)

    def _loop(self) -> dict[str, Any]:
        """Every optimizer step from the resumed one to the last; returns the summary."""
        t, o, tracker = self.cfg.train, self.cfg.optim, self.tracker
        exit_code = 0
        t_run = time.perf_counter()
        start = self.state.step
        try:
            if start == 0:  # the loss at initialisation: ln(vocab) for a well-initialised model
                tracker.log(0, self._validated(0, {}), line=False)
                tracker.info(f"step 0: validation loss {self.state.val_loss:.4f}")
            self.throughput.restart()
            for step in range(start, self.steps):
                if self.stop_poll.poll(self.preemption.requested()):
                    if rows := self._read_health():
                        tracker.log(step, rows[-1], line=False)
                    self.stops.stop(step)
                self._switch_precision(step)
                lr = lr_at(step, self.steps, o.lr, o.warmup_frac, o.start_ratio, o.final_ratio)
                inputs, targets = self.state.loader.next_batch()
                self.health.add(step, lr, self.train_step(step, inputs, targets, lr))
                self.throughput.step()

                done = step + 1
                log_now = done % t.log_every == 0 or done == self.steps
                eval_now = done % t.eval_every == 0 or done == self.steps
                save_now = done % t.ckpt_every == 0 or done == self.steps
                downstream_now = self.validation.downstream.due(done, self.steps)
                if not (log_now or eval_now or save_now or downstream_now):
                    continue
                metrics: dict[str, Any] = self._read_health()[-1]
                if log_now:
                    metrics |= self.throughput.metrics(self.steps - done)  # the GPU has caught up
                if eval_now:
                    metrics = self._validated(done, metrics)
                if downstream_now:
                    metrics |= self.validation.downstream_metrics(self.model)
                tracker.log(done, metrics, line=log_now or eval_now or downstream_now)
                if eval_now:
                    tracker.info(f"step {done}: validation loss {self.state.val_loss:.4f}")
                if save_now:
                    self._save(done)
                if log_now:
                    self.throughput.restart()
            return self._finish(t_run, start)
        except (Preempted, Interrupted):
            raise
        except BaseException:
            exit_code = 1
            raise
        finally:
            tracker.finish(exit_code)

    def _switch_precision(self, step: int) -> None:
        """At the first step of the run that ``quant.schedule`` switches (the switch step, or the
        resumed step after it), switch the quantized linears and tell the step
        (:mod:`training.precision_schedule`)."""
        if self.switch is None or self.switched or not self.switch.active(step):
            return
        layers = set_precision(self.model, self.switch.precision)
        self.switched = True
        self.train_step.precision_changed()
        self.tracker.info(f"step {step}: {layers} quantized linear(s) switch to {self.switch.precision} "
                          f"(quant.schedule.at={self.cfg.quant.schedule.at}, from step {self.switch.step} on)")

    def _read_health(self) -> list[dict[str, Any]]:
        """The metrics of the steps run but not yet read (one wait for the GPU); every row but the
        last is logged here, the last is the caller's. A non-finite step stops the run."""
        try:
            rows = self.health.read()
        except NonFinite as bad:
            raise self.stops.diverged(bad.step, bad.problem) from None
        if rows:
            self.tracker.advance(len(rows))
        for step, row in rows[:-1]:
            self.tracker.log(step + 1, row, line=False)
        return [row for _, row in rows]

    def _validated(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` of step ``step`` with its validation loss(es), and its gap when one is ready."""
        losses = self.validation.losses(self.model)
        self.state.val_loss = losses["val/loss"]
        self.state.val_loss_bf16 = losses.get("val/loss_bf16")
        return self.validation.with_gap(step, metrics | losses, self.tracker.info)

    def _save(self, step: int, force_sync: bool = False) -> Path:
        """Checkpoint the state after ``step`` steps; returns the checkpoint's path."""
        self.state.step = step
        try:
            saved = self.checkpoints.save(step, self.model, self.optimizer, self.state, force_sync=force_sync)
        except CheckpointError as err:
            raise TrainingError(str(err)) from err
        if saved.nbytes == 0:
            self.tracker.info(f"step {step}: already checkpointed in {saved.path}")
        else:
            how = "started in the background" if self.cfg.train.async_checkpoint and not force_sync else "saved"
            self.tracker.info(f"step {step}: checkpoint of {saved.nbytes / 2**20:,.1f} MiB {how} in "
                              f"{saved.seconds:.1f} s: {saved.path}")
        return saved.path

    def _finish(self, t_run: float, start: int) -> dict[str, Any]:
        """Wait for the last checkpoint, write the summary and say how the run ended."""
        try:
            self.checkpoints.wait()
        except CheckpointError as err:
            raise TrainingError(str(err)) from err
        steps, tokens = self.steps, self.steps * self.tokens_per_step
        summary = {"final_val_loss": self.state.val_loss, "steps": steps, "tokens": tokens,
                   "non_embedding_params": self.n_params, "scheme": self.scheme.name,
                   "model": self.cfg.model.name, "world_size": self.di.world_size}
        if self.state.val_loss_bf16 is not None:
            summary["final_val_loss_bf16"] = self.state.val_loss_bf16
        summary |= self.validation.final_gap(steps, self.run_dir, self.tracker)
        self.tracker.summary(summary)
        minutes = (time.perf_counter() - t_run) / 60
        self.tracker.info(f"done: final validation loss {self.state.val_loss:.4f} after {steps} steps "
                          f"({tokens_text(tokens)} tokens), {minutes:.1f} min"
                          + (f" since resuming at step {start}" if start else "") + "; "
                          f"results in {self.run_dir}")
        return summary


def already_finished(run_dir: Path, steps: int, main_rank: bool) -> dict[str, Any]:
    """A finished run started again: say so, write nothing, return its summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if main_rank:
        print(f"run {run_dir} is already finished ({steps} of {steps} steps, final validation loss "
              f"{summary.get('final_val_loss', float('nan')):.4f}); nothing to do. Results: "
              f"{run_dir / 'summary.json'}, {run_dir / 'metrics.jsonl'}. To train it again from step "
              f"0: resume=false (the finished run is moved aside).", flush=True)
    return summary
