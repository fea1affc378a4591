"""Tests of the trainer (train.py, training/): tiny CPU runs through ``trainer.run(cfg)``.

Runs use the tiny model on the bundled corpus (prepared once per pytest run, see conftest.py), 8
sequences of 128 tokens per step, FP32 unless BF16 is the point, and a handful of steps: about
half a minute in all on 2 idle cores.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import quant
from data.loader import read_split, val_batches
from data.prepare import load_manifest, prepare_from_config
from model import build_model
from model.llama import Llama, RMSNorm
from training import errors, identity, trainer
from training.checkpoint import Checkpointer, read_extra
from training.config_checks import ConfigError
from training.optim import build_adamw, lr_at, param_groups
from training.preemption import REQUEUE_FILE, STOP_FILE
from training.step import TrainStep, graph_blocker

REPO = Path(__file__).resolve().parents[1]

# Single-process DCP checkpoints warn that no process group exists: that is the intended mode.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: record}; every step must appear once. (Rows without a step, loss
    gaps filled in at the end of a run, are on their own axis, ``gap_step``.)"""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"steps logged more than once: {steps}"
    return {r["step"]: r for r in rows}


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run."""
    return [step for step, _ in Checkpointer(Path(run_dir) / "checkpoints").all()]


def checkpoint_state(path: Path, scratch: Path) -> dict:
    """A DCP checkpoint directory as one plain state dict ({"model": ..., "optim": ...})."""
    dcp_to_torch_save(path, scratch)
    return torch.load(scratch, map_location="cpu", weights_only=False)


def assert_same_tensors(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}/{i}")
    else:
        assert a == b, where


# ----------------------------------------------------------------------------- training


def unigram_baseline(cfg) -> float:
    """Cross-entropy, on the validation batches the trainer evaluates, of the best context-free
    predictor: the train split's token frequencies (add-one smoothed)."""
    data_dir = prepare_from_config(cfg.data)
    manifest = load_manifest(data_dir)
    train_tokens = read_split(data_dir, "train")
    counts = np.bincount(train_tokens, minlength=manifest["vocab_size"]) + 1.0
    log_p = np.log(counts / counts.sum())
    targets = np.concatenate([
        y.numpy().ravel()
        for _, y in val_batches(data_dir, cfg.train.seq_len, cfg.train.eval_batch_size, cfg.train.eval_batches)
    ])
    return float(-log_p[targets].mean())


def test_tiny_run_loss_falls(tiny):
    # 40 steps of 4×128 tokens: 20k tokens, 0.04 tokens per parameter.
    cfg = tiny("train.steps=40", "train.batch_size=4", "train.micro_batch_size=4", "train.eval_every=10",
               "train.eval_batches=2", "train.ckpt_every=1000")
    summary = trainer.run(cfg)
    metrics = read_metrics(cfg.run_dir)
    assert sorted(metrics) == list(range(0, 41))

    # At init the model predicts the uniform distribution: loss ln(vocab), on validation (step 0,
    # evaluated before training) and on the first training batch.
    uniform = math.log(cfg.model.vocab_size)
    assert metrics[0]["val/loss"] == pytest.approx(uniform, abs=0.1)
    assert metrics[1]["train/loss"] == pytest.approx(uniform, abs=0.1)

    evals = [metrics[s]["val/loss"] for s in (10, 20, 30, 40)]
    assert summary["final_val_loss"] == evals[-1]
    assert evals[-1] < evals[0] - 0.1, evals
    # Better than any context-free model: it learned more than the token frequencies.
    baseline = unigram_baseline(cfg)
    assert baseline < uniform - 1.0  # sanity of the baseline itself
    assert evals[-1] < baseline, (evals, baseline)

    # The trainer followed the schedule: lr/100 at the first step, lr/10 at the last.
    assert metrics[1]["train/lr"] == pytest.approx(cfg.optim.lr / 100)
    assert metrics[40]["train/lr"] == pytest.approx(cfg.optim.lr / 10)
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 4 * 128
    assert summary["scheme"] == "quartet2" and summary["model"] == "tiny"
    assert json.loads((Path(cfg.run_dir) / "summary.json").read_text()) == summary
    assert checkpoint_steps(cfg.run_dir) == [40]  # the final checkpoint is always written


def interrupt(how: str, stop: int, monkeypatch: pytest.MonkeyPatch, run_dir: Path):
    """Patches that stop a run after ``stop`` steps: ``ctrl_c`` raises KeyboardInterrupt right
    after the checkpoint of step ``stop`` is written; ``preempt`` drops the stop-request file (as
    the Slurm batch script does) once step ``stop`` has run, so the run checkpoints and exits."""
    if how == "ctrl_c":
        real_save = Checkpointer.save

        def save_then_interrupt(self, step, *args, **kwargs):
            path = real_save(self, step, *args, **kwargs)
            if step == stop:
                raise KeyboardInterrupt
            return path

        monkeypatch.setattr(Checkpointer, "save", save_then_interrupt)
        return KeyboardInterrupt
    real_step = TrainStep.__call__

    def step_then_request_stop(self, step, *args, **kwargs):
        health = real_step(self, step, *args, **kwargs)
        if step + 1 == stop:
            (run_dir / STOP_FILE).touch()
        return health

    monkeypatch.setattr(TrainStep, "__call__", step_then_request_stop)
    return errors.Preempted


@pytest.mark.parametrize("setting,interruptions", [
    # ctrl_c at 6: after the final checkpoint, before the summary is written.
    pytest.param(["quant=quartet2"], [("ctrl_c", 3), ("preempt", 4), ("ctrl_c", 6)], id="quartet2"),
    pytest.param(["quant=bf16", "precision=bf16"], [("ctrl_c", 3)], id="bf16"),
])
def test_resume_reproduces_uninterrupted_run(tiny, tmp_path, monkeypatch, setting, interruptions):
    steps = 6
    common = [*setting, f"train.steps={steps}", "train.ckpt_every=3", "train.eval_every=3"]

    cfg_a = tiny(*common, run="a")
    summary_a = trainer.run(cfg_a)
    metrics_a = read_metrics(cfg_a.run_dir)
    final_a = checkpoint_state(Path(cfg_a.run_dir) / "checkpoints" / f"step_{steps:08d}", tmp_path / "a.pt")

    for how, stop in interruptions:
        cfg_b = tiny(*common, run=f"b-{how}-{stop}")
        run_dir = Path(cfg_b.run_dir)
        with monkeypatch.context() as m:
            stopped = interrupt(how, stop, m, run_dir)
            with pytest.raises(stopped):
                trainer.run(cfg_b)
        assert checkpoint_steps(run_dir)[-1] == stop
        assert sorted(read_metrics(run_dir)) == list(range(0, stop + 1))
        if how == "preempt":
            assert (run_dir / REQUEUE_FILE).is_file()

        summary_b = trainer.run(cfg_b)  # resume=true is the default
        metrics_b = read_metrics(run_dir)
        assert sorted(metrics_b) == list(range(0, steps + 1))
        assert f"resuming at step {stop}" in (run_dir / "train.log").read_text()
        for step in range(1, steps + 1):
            for key in ("train/loss", "train/grad_norm", "train/lr"):
                assert metrics_b[step][key] == metrics_a[step][key], (how, step, key)
        assert metrics_b[steps]["val/loss"] == metrics_a[steps]["val/loss"]
        assert summary_b == summary_a
        # Bit-identical weights and optimizer moments at the end.
        final_b = checkpoint_state(run_dir / "checkpoints" / f"step_{steps:08d}", tmp_path / f"{how}-{stop}.pt")
        assert_same_tensors(final_a, final_b)
        assert not (run_dir / STOP_FILE).exists() and not (run_dir / REQUEUE_FILE).exists()

    # Resuming a finished run trains nothing more and reports the same result.
    assert trainer.run(cfg_b) == summary_a
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps + 1


@pytest.mark.parametrize("change,key,old,new", [
    ("quant=nvidia", "quant.name", "quartet2", "nvidia"),
    ("model.n_layer=3", "model.n_layer", 2, 3),
    ("precision=bf16", "precision", "fp32", "bf16"),
    ("train.micro_batch_size=4", "train.micro_batch_size", 8, 4),
])
def test_resume_refuses_checkpoint_of_another_config(tiny, change, key, old, new):
    cfg = tiny("train.steps=1")
    trainer.run(cfg)
    saved = checkpoint_steps(cfg.run_dir)
    assert saved == [1]

    with pytest.raises(ValueError) as info:
        trainer.run(tiny("train.steps=1", change))
    msg = str(info.value)
    differing = re.findall(r"([\w.]+): (\S+) in the checkpoint, (\S+) now", msg)
    assert differing == [(key, repr(old), repr(new))], msg
    assert "Fix:" in msg and "run_name=" in msg and "resume=false" in msg
    assert f"resume_with_changes=[{key}]" in msg
    assert checkpoint_steps(cfg.run_dir) == saved


def test_nan_loss_stops_with_last_good_checkpoint(tiny, monkeypatch):
    good_steps = 4  # steps 1..4 are fine, step 5 (the 5th optimizer step) gives NaN
    real_forward = Llama.forward
    calls = {"train": 0}

    def forward(self, idx, targets=None):
        out = real_forward(self, idx, targets)
        if self.training:
            calls["train"] += 1
            if calls["train"] > good_steps:
                return out * float("nan")
        return out

    monkeypatch.setattr(Llama, "forward", forward)
    cfg = tiny("train.steps=8", "train.ckpt_every=2", "train.eval_every=1000")
    with pytest.raises(errors.TrainingError) as info:
        trainer.run(cfg)
    msg = str(info.value)
    last_good = Path(cfg.run_dir) / "checkpoints" / f"step_{good_steps:08d}"
    assert "nan" in msg.lower()
    assert re.search(rf"\bstep {good_steps + 1}\b", msg), msg
    assert str(last_good) in msg
    assert "Fix:" in msg
    # The last good checkpoint is kept and nothing newer (or half-written) is there.
    assert checkpoint_steps(cfg.run_dir) == [2, 4]
    assert sorted(p.name for p in last_good.parent.iterdir()) == ["step_00000002", "step_00000004"]
    assert max(read_metrics(cfg.run_dir)) == good_steps
    assert read_extra(last_good)["step"] == good_steps


# ----------------------------------------------------------------------------- W&B


def wandb_inspect(run_folder: Path, *flags: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_folder)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_wandb_offline_run_holds_the_logged_metrics(tiny):
    cfg = tiny("wandb.enabled=true", "wandb.mode=offline", "train.steps=4", "train.eval_every=2",
               "train.log_every=2")
    summary = trainer.run(cfg)
    metrics = read_metrics(cfg.run_dir)
    folders = list((Path(cfg.run_dir) / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, folders

    records = [json.loads(line) for line in wandb_inspect(folders[0]).splitlines() if line.strip()]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == sorted(metrics) == [0, 1, 2, 3, 4]
    for step, row in metrics.items():
        for key, value in row.items():
            if key != "step":
                assert history[step][key] == value, (step, key)
    assert "val/loss" in history[2] and "perf/tokens_per_s" in history[4]

    run = json.loads(wandb_inspect(folders[0], "--summary"))
    assert run["name"] == cfg.run_name == "tiny-quartet2-4steps-s0"
    assert run["state"] == "finished" and run["exit_code"] == 0
    assert run["config"]["model"]["name"] == "tiny" and run["config"]["model"]["d_model"] == 128
    assert run["config"]["quant"]["name"] == "quartet2"
    assert run["config"]["optim"]["lr"] == cfg.model.peak_lr  # resolved, not "${model.peak_lr}"
    assert run["config"]["run_name"] == cfg.run_name
    assert run["summary"]["final_val_loss"] == summary["final_val_loss"] == metrics[4]["val/loss"]
    # The checkpoint remembers the W&B run, so that a resumed run continues it.
    assert read_extra(Path(cfg.run_dir) / "checkpoints" / "step_00000004")["wandb_run_id"] == run["run_id"]


# ----------------------------------------------------------------------------- budget, schedule, optimizer


def test_token_budget_in_steps(compose_train):
    cfg = compose_train(["train.tokens_per_param=100", "train.batch_size=16", "train.seq_len=128"])
    tokens_per_step = 16 * 128
    n = build_model(cfg.model, device="meta").num_params(non_embedding=True)
    assert identity.total_steps(cfg, n) == math.ceil(100 * n / tokens_per_step)
    assert identity.total_steps(cfg, tokens_per_step) == 100  # exact: no extra step
    assert identity.total_steps(cfg, tokens_per_step + 1) == 101  # a partial step rounds up
    assert identity.total_steps(compose_train(["train.tokens_per_param=100", "model=1.9b"]), 1_644_300_288) \
        == math.ceil(100 * 1_644_300_288 / (16 * 128))

    assert identity.total_steps(compose_train(["train.steps=123"]), n) == 123
    with pytest.raises(errors.TrainingError, match="train.steps=N or train.tokens_per_param=T"):
        identity.total_steps(compose_train(["train.steps=0"]), n)


def test_token_budget_drives_the_run(tiny):
    # 0.003 tokens/param × 524,928 = 1,575 tokens: 2 steps of 1,024.
    cfg = tiny("train.tokens_per_param=0.003", "train.steps=999")
    n = build_model(cfg.model, device="meta").num_params(non_embedding=True)
    expected = math.ceil(0.003 * n / 1024)
    assert expected == 2
    summary = trainer.run(cfg)
    assert summary["steps"] == expected and summary["non_embedding_params"] == n
    assert sorted(read_metrics(cfg.run_dir)) == [0, 1, 2]
    assert cfg.run_name == "tiny-quartet2-0.003tpp-s0"


@pytest.mark.parametrize("total", [10, 40, 1000, 1001])
def test_lr_schedule(total):
    peak = 3e-3
    lrs = [lr_at(s, total, peak) for s in range(total)]
    warmup = math.ceil(0.1 * total)
    assert lrs[0] == pytest.approx(peak / 100)
    assert lrs[warmup] == pytest.approx(peak)  # the peak right at the end of warmup
    assert max(lrs) == pytest.approx(peak) and max(lrs[:warmup]) < peak
    assert lrs[-1] == pytest.approx(peak / 10)
    assert min(lrs) == pytest.approx(peak / 100)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup + 1]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # then decays
    assert min(lrs[warmup:]) == pytest.approx(peak / 10)
    # Halfway through the decay, the cosine is halfway between peak and peak/10.
    if (total - 1 - warmup) % 2 == 0:
        assert lrs[(warmup + total - 1) // 2] == pytest.approx(peak * (0.1 + 0.9 / 2))


def test_weight_decay_on_linear_weights_only(compose_train):
    cfg = compose_train(["quant=quartet2"])
    model = build_model(cfg.model, device="cpu")
    quant.quantize_model(model, quant.scheme_from_config(cfg.quant),
                         skip=quant.skip_patterns(cfg.quant, cfg.model.n_layer))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {id(p) for p in decay["params"]}
    not_decayed = {id(p) for p in no_decay["params"]}
    assert not decayed & not_decayed
    assert decayed | not_decayed == {id(p) for p in model.parameters()}

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * cfg.model.n_layer + 1  # block linears (QuantLinear) + lm_head
    assert decayed == {id(m.weight) for m in linears}
    assert id(model.lm_head.weight) in decayed
    assert id(model.tok_emb.weight) in not_decayed
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * cfg.model.n_layer + 1 and {id(p) for p in norms} <= not_decayed

    opt = build_adamw(model, 1e-3, (0.9, 0.95), 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(decayed), len(not_decayed)]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("override,error,message", [
    ("train.seq_len=512", ConfigError, r"train\.seq_len=512 exceeds model\.max_seq_len=256"),
    ("train.micro_batch_size=3", ConfigError,
     r"train\.batch_size=8 must split into 1 rank\(s\) × micro-batches of train\.micro_batch_size=3"),
    ("model.vocab_size=1000", ValueError, r"vocabulary \(4096 pieces\) is bigger than the model's embedding \(1000"),
    ("data.inputs=[/nonexistent.txt]", FileNotFoundError, r"/nonexistent\.txt"),
], ids=["seq_len", "micro_batch", "vocab", "missing_input"])
def test_bad_inputs_fail_with_clear_errors(tiny, override, error, message):
    cfg = tiny(override)
    with pytest.raises(error, match=message):
        trainer.run(cfg)
    assert checkpoint_steps(cfg.run_dir) == []


def test_cli_reports_run_errors_without_traceback(data_cache, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [sys.executable, "train.py", *FAST, f"data.cache_dir={data_cache}", f"run_dir={tmp_path / 'run'}",
         "train.seq_len=512"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "error: train.seq_len=512 exceeds model.max_seq_len=256" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_refused_command_and_finished_rerun_leave_the_run_as_it_was(data_cache, tmp_path):
    """A command refused at its checks, or a finished run started again, changes nothing of the
    run directory: not its ``.hydra/`` record of the command, not ``config.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    command = [sys.executable, "train.py", *FAST, f"data.cache_dir={data_cache}", f"run_root={tmp_path}",
               "hydra.run.dir=" + str(run_dir), f"run_dir={run_dir}", "train.steps=2", "quant=bf16"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / ".hydra" / "overrides.yaml").is_file() and (run_dir / "config.json").is_file()
    before = _snapshot(run_dir)
    refused = subprocess.run([*command, "train.batch_size=7", "train.micro_batch_size=2"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "train.batch_size=7" in refused.stderr
    assert _snapshot(run_dir) == before
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already finished" in again.stdout
    assert _snapshot(run_dir) == before


def test_compiled_blocks_train_like_eager(tiny, tmp_path, monkeypatch):
    """compile=true (per-block torch.compile, model/parallel.py) trains a quantized model and
    gives the eager losses and gradient norms up to kernel-fusion rounding (fp32: relative 1e-4).

    The backward quantization is off here (``quant.backward=false``): fused norms change the
    gradients flowing into the backward quantizers by ~1e-9, which flips an occasional
    stochastic scale rounding of MS-EDEN (a whole E4M3 step of one group) and moved the gradient
    norm by 1.3e-4 relative at step 1. The quantized backward under compile is checked on its
    own, bit for bit, in tests/test_linear.py (``test_compiled_quantized_linear_equals_eager``)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    overrides = ("precision=fp32", "train.steps=2", "train.batch_size=4", "train.micro_batch_size=4",
                 "train.eval_batches=1", "train.ckpt_every=1000", "quant.backward=false")
    eager = trainer.run(tiny(*overrides, run="eager"))
    compiled = trainer.run(tiny(*overrides, "compile=true", run="compiled"))
    a, b = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    for step in (1, 2):
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-4)
        assert b[step]["train/grad_norm"] == pytest.approx(a[step]["train/grad_norm"], rel=1e-4)
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-4)


# ----------------------------------------------------------------------------- the step as a CUDA graph


def test_graph_blocker_names_each_reason():
    from quant import backend

    cuda = torch.device("cuda", 0)
    assert graph_blocker(cuda, False, "default", "quartet2") is None
    assert "not a CUDA GPU" in graph_blocker(torch.device("cpu"), False, "default", "quartet2")
    assert "FSDP2" in graph_blocker(cuda, True, "default", "bf16")
    assert "reduce-overhead" in graph_blocker(cuda, False, "reduce-overhead", "bf16")
    with backend.use_backend("reference"):
        assert "NVFP4_BACKEND=reference" in graph_blocker(cuda, False, "default", "nvidia")
        assert graph_blocker(cuda, False, "default", "bf16") is None  # nothing is quantized
    with backend.use_backend("auto", draws="torch"):
        assert "NVFP4_DRAWS=torch" in graph_blocker(cuda, False, "default", "quartet2")


@pytest.mark.parametrize("key,value", [("cuda_graph", "yes"), ("parallel.fsdp", "false")])
def test_graph_and_fsdp_settings_are_checked(tiny, key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        trainer.run(tiny(f"{key}={value}"))


def test_cuda_graph_true_where_it_cannot_run_names_why(tiny):
    with pytest.raises(errors.TrainingError, match=r"cuda_graph=true.*runs on cpu.*cuda_graph=auto"):
        trainer.run(tiny("cuda_graph=true"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the step graph needs a CUDA GPU")
@pytest.mark.parametrize("switch", [[], ["quant.schedule.at=6"]], ids=["one-graph", "forward-to-bf16-at-6"])
def test_replayed_step_graph_trains_the_same_bits_as_eager_steps(tiny, switch):
    """quartet2, compiled: every logged loss and gradient norm of a run whose steps replay one CUDA
    graph equals that of the same run stepped eagerly, bit for bit (the step's changing values
    reach the graph as data: batch, learning rate, each micro-step's Philox key); with a forward
    switch to BF16 at step 6 the graph is captured again there, and the bits still match."""
    common = ["device=cuda", "precision=bf16", "compile=true", "train.steps=12", "train.log_every=4",
              "train.eval_every=6", "train.ckpt_every=6", "train.micro_batch_size=4", *switch]
    losses = {}
    for graph in ("true", "false"):
        cfg = tiny(*common, f"cuda_graph={graph}", run=f"graph-{graph}")
        trainer.run(cfg)
        rows = read_metrics(cfg.run_dir)
        losses[graph] = [(s, r.get("train/loss"), r.get("train/grad_norm"), r.get("val/loss"))
                         for s, r in sorted(rows.items())]
    assert losses["true"] == losses["false"]
