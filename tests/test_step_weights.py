"""The forward's Ŵ quantized once per optimizer step (quant/step_weights.py): the same bits as
quantizing it in every micro-batch, and one weight quantization per step instead of one per
micro-batch."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from test_train import assert_same_tensors, checkpoint_state, read_metrics

import quant.linear
import quant.step_weights
from quant import get_scheme
from quant.step_weights import caches_forward_weight, forward_weight
from training import step as train_step
from training import trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCHEMES = ("nvidia", "four_over_six", "tetrajet_v2", "quartet2")


@contextlib.contextmanager
def _per_micro_batch(model):
    """The step without the cache: each micro-batch's forward quantizes W itself."""
    yield 0


def _count_weight_quantizations(monkeypatch) -> dict:
    """Counts the forward weights quantized in a forward GEMM, and those quantized once per step
    (with the layers they belong to)."""
    counts = {"in_forward": 0, "once": 0, "layers": set()}
    gemm, once = quant.linear.quantized_gemm, quant.step_weights.forward_weight

    def counting_gemm(a, b, g, role, *args, b_quantized=None, **kwargs):
        counts["in_forward"] += role == "forward" and b_quantized is None
        return gemm(a, b, g, role, *args, b_quantized=b_quantized, **kwargs)

    def counting_once(weight, scheme):
        counts["once"] += 1
        counts["layers"].add(id(weight))
        return once(weight, scheme)

    monkeypatch.setattr(quant.linear, "quantized_gemm", counting_gemm)
    monkeypatch.setattr(quant.step_weights, "forward_weight", counting_once)
    return counts


@pytest.mark.parametrize("scheme", SCHEMES)
def test_once_per_step_trains_the_same_bits(tiny, tmp_path, monkeypatch, scheme):
    """20 steps of 2 micro-batches: every loss and gradient norm, the validation losses and the
    final weights and optimizer state equal those of quantizing W in each micro-batch."""
    runs = {}
    for mode in ("per_micro_batch", "once"):
        with monkeypatch.context() as m:
            if mode == "per_micro_batch":
                m.setattr(train_step, "quantized_once", _per_micro_batch)
            cfg = tiny(f"quant={scheme}", "train.steps=20", "train.micro_batch_size=4", "train.eval_every=10",
                       "train.ckpt_every=20", run=mode)
            trainer.run(cfg)
        rows = read_metrics(cfg.run_dir)
        runs[mode] = (
            [(s, r.get("train/loss"), r.get("train/grad_norm"), r.get("val/loss")) for s, r in sorted(rows.items())],
            checkpoint_state(Path(cfg.run_dir) / "checkpoints" / "step_00000020", tmp_path / f"{mode}.pt"),
        )
    assert len(runs["once"][0]) >= 20
    assert runs["once"][0] == runs["per_micro_batch"][0]
    assert_same_tensors(runs["once"][1]["model"], runs["per_micro_batch"][1]["model"], "model")
    assert_same_tensors(runs["once"][1]["optim"], runs["per_micro_batch"][1]["optim"], "optim")


def test_each_weight_is_quantized_once_per_step(tiny, monkeypatch):
    """nvidia, 3 steps of 2 micro-batches: one forward-weight quantization per layer and step,
    where each micro-batch's forward quantized it before (validation quantizes in its forward
    either way)."""
    counts = {}
    for mode in ("per_micro_batch", "once"):
        with monkeypatch.context() as m:
            counts[mode] = _count_weight_quantizations(m)
            if mode == "per_micro_batch":
                m.setattr(train_step, "quantized_once", _per_micro_batch)
            cfg = tiny("quant=nvidia", "train.steps=3", "train.micro_batch_size=4", "train.eval_every=1000",
                       "train.ckpt_every=1000", run=mode)
            trainer.run(cfg)
    once, per = counts["once"], counts["per_micro_batch"]
    layers = len(once["layers"])
    assert layers > 0 and per["once"] == 0
    assert once["once"] == 3 * layers
    validation = once["in_forward"]
    assert per["in_forward"] == 3 * 2 * layers + validation


def test_forward_weight_is_what_the_forward_gemm_uses():
    """Ŵ from :func:`forward_weight` gives the forward's product bit for bit, for each scheme."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    for name in SCHEMES:
        scheme = get_scheme(name)
        layer = torch.zeros(2, dtype=torch.int64)
        expected = quant.linear.quantized_linear(x, w, scheme, layer)
        got = quant.linear.quantized_linear(x, w, scheme, layer, step_weight=forward_weight(w, scheme))
        assert torch.equal(got, expected), name


def test_delayed_amax_layers_quantize_in_every_micro_batch():
    assert caches_forward_weight(get_scheme("quartet2"))
    assert not caches_forward_weight(get_scheme("nvidia", delayed_amax=True))
    assert not caches_forward_weight(get_scheme("quartet2", forward=False))
