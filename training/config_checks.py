"""Checks of a run's settings before anything is built, each error naming the key, its value and
the fix (the loop would otherwise fail late, or train something other than what was asked)."""

from __future__ import annotations

from omegaconf import DictConfig

from .errors import ConfigError
from .identity import check_budget, positive_int


def check_train_config(cfg: DictConfig, world_size: int) -> None:
    """Raise :class:`ConfigError` for a setting of ``cfg.train`` (and the batch split over
    ``world_size`` ranks) that cannot work."""
    t = cfg.train
    for key in ("seq_len", "batch_size", "micro_batch_size", "log_every", "eval_every", "ckpt_every",
                "eval_batches", "eval_batch_size"):
        if not positive_int(t[key]):
            raise ConfigError(f"train.{key}={t[key]} must be a whole number ≥ 1. Fix: set train.{key}=N with N ≥ 1.")
    check_budget(t.steps, t.tokens_per_param)
    keep = t.keep_checkpoints
    if keep is not None and not positive_int(keep):
        raise ConfigError(
            f"train.keep_checkpoints={keep} would delete every checkpoint. Fix: a number ≥ 1 (the "
            f"newest N are kept), or train.keep_checkpoints=null to keep all."
        )
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}. "
            f"Fix: lower train.seq_len or raise model.max_seq_len."
        )
    rows_per_rank, rem = divmod(t.batch_size, world_size)
    if rem or rows_per_rank % t.micro_batch_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} must split into {world_size} rank(s) × "
            f"micro-batches of train.micro_batch_size={t.micro_batch_size}. Fix: make the "
            f"batch a multiple of world_size × micro_batch_size."
        )
    if t.eval_batch_size % world_size:
        raise ConfigError(
            f"train.eval_batch_size={t.eval_batch_size} is not divisible by the "
            f"{world_size} ranks. Fix: make it a multiple of the world size."
        )
    if t.eval_bf16 not in ("auto", True, False):
        raise ConfigError(f"train.eval_bf16={t.eval_bf16} must be auto (on for quantized runs), true or false.")
    if cfg.cuda_graph not in ("auto", True, False):
        raise ConfigError(f"cuda_graph={cfg.cuda_graph} must be auto, true or false.")
    if cfg.parallel.fsdp not in ("auto", True):
        raise ConfigError(f"parallel.fsdp={cfg.parallel.fsdp} must be auto (FSDP2 when world size > 1) or "
                          f"true (also in one process).")
    for key in ("timeout_s", "stop_grace_s"):
        value = cfg.parallel[key]
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"parallel.{key}={value} must be a positive number of seconds.")
