"""Shared fixtures of the trainer tests: W&B kept offline and quiet, the sample dataset prepared
once per pytest run in a temporary cache, and in-process composition of configs/train.yaml."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _wandb_offline(tmp_path_factory: pytest.TempPathFactory):
    """No test talks to W&B's servers or writes W&B files outside the test's temporary dirs."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_CONFIG_DIR", str(home / "config"))
        mp.setenv("WANDB_CACHE_DIR", str(home / "cache"))
        mp.setenv("WANDB_DATA_DIR", str(home / "data"))
        yield


@pytest.fixture(scope="session")
def compose_train() -> Callable[[Iterable[str]], DictConfig]:
    """``compose_train(overrides)``: configs/train.yaml composed as ``python train.py`` would."""

    def _compose(overrides: Iterable[str] = ()) -> DictConfig:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose("train", overrides=list(overrides), return_hydra_config=False)

    return _compose


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory, compose_train) -> Path:
    """A data cache dir holding the prepared default (sample) dataset; pass it as
    ``data.cache_dir=...`` so that runs reuse it instead of touching data/cache."""
    from data.prepare import prepare_from_config

    cache = tmp_path_factory.mktemp("nfp4-data-cache")
    prepare_from_config(compose_train([f"data.cache_dir={cache}"]).data)
    return cache


FAST = [
    "device=cpu",
    "precision=fp32",
    "wandb.enabled=false",
    "train.seq_len=128",
    "train.batch_size=8",
    "train.micro_batch_size=8",  # 1024 tokens per micro-batch: quartet2's wgrad rotates by 128
    "train.eval_batches=1",
    "train.eval_batch_size=8",
    "train.log_every=1000",
]


@pytest.fixture
def tiny(compose_train, data_cache, tmp_path):
    """``tiny(*overrides, run="run")``: a fast tiny-model config whose run_dir is tmp_path/run."""

    def _cfg(*overrides: str, run: str = "run"):
        return compose_train([*FAST, f"data.cache_dir={data_cache}", f"run_dir={tmp_path / run}",
                              f"run_root={tmp_path}", *overrides])

    # run() restores the signal handlers it installs; should a test break off a run before that,
    # the test process still gets its own back, so that it stops on SIGTERM.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield _cfg
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
