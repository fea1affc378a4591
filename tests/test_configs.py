"""Tests of the Hydra configs (configs/): every preset composes and builds, run names encode the
experiment, and typos fail at composition with Hydra's own errors. No training here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from torch import nn

import quant
import train
from model import build_model
from quant import QuantLinear

REPO = Path(__file__).resolve().parents[1]
MODELS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml"))
QUANTS = sorted(p.stem for p in (REPO / "configs" / "quant").glob("*.yaml"))
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.up_gate", "mlp.down")


def test_preset_lists_are_complete():
    assert {"tiny", "30m", "50m", "100m", "200m", "1.9b"} <= set(MODELS)
    # Every scheme of the library can be chosen with quant=<name>, and only those.
    assert set(QUANTS) == set(quant.SCHEMES)


@pytest.mark.parametrize("quant_name", QUANTS)
@pytest.mark.parametrize("model_name", MODELS)
def test_every_model_and_quant_preset_composes_and_builds_on_meta(compose_train, model_name, quant_name):
    cfg = compose_train([f"model={model_name}", f"quant={quant_name}"])
    assert cfg.model.name == model_name and cfg.quant.name == quant_name
    model = build_model(cfg.model, device="meta")
    scheme = train.scheme_from_config(cfg.quant)
    quant.quantize_model(model, scheme, skip=train.skip_patterns(cfg.quant, cfg.model.n_layer))

    assert len(model.blocks) == cfg.model.n_layer
    for i, block in enumerate(model.blocks):
        for name in BLOCK_LINEARS:
            layer = block.get_submodule(name)
            assert layer.weight.is_meta
            if quant_name == "bf16":
                assert type(layer) is nn.Linear, f"blocks.{i}.{name} should stay nn.Linear under bf16"
            else:
                assert isinstance(layer, QuantLinear), f"blocks.{i}.{name} is {type(layer).__name__}"
                assert layer.scheme == scheme
    assert type(model.lm_head) is nn.Linear  # the head always stays in high precision
    # The optimizer's learning rate follows the model preset.
    assert cfg.optim.lr == cfg.model.peak_lr


def test_quartet2_on_the_1_9b_model_names_its_run(compose_train):
    cfg = compose_train(["quant=quartet2", "model=1.9b", "train.tokens_per_param=100"])
    assert cfg.model.name == "1.9b" and cfg.model.n_layer == 32 and cfg.quant.name == "quartet2"
    assert cfg.run_name == "1.9b-quartet2-100tpp-s0"
    assert cfg.run_group == "1.9b-100tpp"  # schemes of one size and budget share a group

    cfg = compose_train(["quant=nvidia", "model=30m", "train.steps=500", "seed=3"])
    assert cfg.run_name == "30m-nvidia-500steps-s3"
    assert cfg.run_group == "30m-500steps"


def test_unknown_group_option_fails_at_compose_and_lists_the_options(compose_train):
    with pytest.raises(MissingConfigException) as info:
        compose_train(["quant=quartet3"])
    msg = str(info.value)
    assert "quant/quartet3" in msg
    listed = re.search(r"Available options in 'quant':\n((?:\t.+\n)+)", msg)
    assert listed, msg
    assert set(listed.group(1).split()) == set(QUANTS)


def test_unknown_key_fails_at_compose_naming_it(compose_train):
    with pytest.raises(ConfigCompositionException, match=r"model\.n_layers"):
        compose_train(["model.n_layers=3"])
    # Adding a key on purpose (+key=...) composes, but the model builder still refuses it.
    cfg = compose_train(["+model.n_layers=3"])
    with pytest.raises(ValueError, match="n_layers"):
        build_model(cfg.model, device="meta")


def test_cli_reports_unknown_option_without_traceback():
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [sys.executable, "train.py", "quant=quartet3"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "quartet3" in out
    assert "quartet2" in out and "nvidia" in out  # valid options are listed
    assert "Traceback" not in out, out


@pytest.mark.parametrize("quant_name", QUANTS)
def test_quant_preset_is_the_library_scheme(compose_train, quant_name):
    cfg = compose_train([f"quant={quant_name}"])
    assert cfg.quant.name in quant.SCHEMES
    # With every ablation switch at its default, the preset is exactly the library's scheme.
    assert train.scheme_from_config(cfg.quant) == quant.SCHEMES[quant_name]
    assert list(cfg.quant.skip) == ["lm_head"]


@pytest.mark.parametrize("quant_name", [q for q in QUANTS if q != "bf16"])
def test_ablation_switches_reach_the_scheme(compose_train, quant_name):
    def scheme(*overrides: str) -> quant.Scheme:
        return train.scheme_from_config(compose_train([f"quant={quant_name}", *overrides]).quant)

    base = scheme()
    assert base.forward.quantized and base.dgrad.quantized and base.wgrad.quantized

    no_bwd = scheme("quant.backward=false")
    for gemm in (no_bwd.dgrad, no_bwd.wgrad):
        assert not gemm.quantized and gemm.rotation is None
    assert no_bwd.forward == base.forward

    no_fwd = scheme("quant.forward=false")
    assert not no_fwd.forward.quantized
    assert (no_fwd.dgrad, no_fwd.wgrad) == (base.dgrad, base.wgrad)

    assert scheme("quant.delayed_amax=true").delayed_amax and not base.delayed_amax

    rotated = [g for g in ("dgrad", "wgrad") if getattr(base, g).rotation]
    assert rotated, "every NVFP4 scheme rotates at least one backward GEMM"
    for g in rotated:
        assert getattr(scheme("quant.rotation=64"), g).rotation == 64

    fwd_46 = scheme("quant.four_over_six=true").forward
    assert fwd_46.a.four_over_six and fwd_46.b.four_over_six
    fwd_no46 = scheme("quant.four_over_six=false").forward
    assert not fwd_no46.a.four_over_six and not fwd_no46.b.four_over_six


def test_sr_four_over_six_reaches_the_sr_operands(compose_train):
    biased = train.scheme_from_config(compose_train(["quant=nvidia", "quant.sr_four_over_six=true"]).quant)
    assert biased.dgrad.a.quantizer == "sr" and biased.dgrad.a.four_over_six
    assert biased.wgrad.a.four_over_six
    assert not quant.SCHEMES["nvidia"].dgrad.a.four_over_six


def test_range_alignment_reaches_the_ms_eden_operands(compose_train):
    """quartet2's MS-EDEN operands use post hoc range alignment by default; ``amax`` (or delayed
    amax) switches every one of them back; a wrong value or post hoc with delayed amax is refused."""
    def eden_posthoc(*overrides: str) -> set[bool]:
        s = train.scheme_from_config(compose_train(["quant=quartet2", *overrides]).quant)
        ops = [o for g in (s.dgrad, s.wgrad) for o in (g.a, g.b)]
        assert {o.quantizer for o in ops} == {"ms_eden"}
        return {o.posthoc for o in ops}

    assert eden_posthoc() == {True}
    assert eden_posthoc("quant.range_alignment=amax") == {False}
    assert eden_posthoc("quant.delayed_amax=true") == {False}
    with pytest.raises(ValueError, match="range_alignment"):
        eden_posthoc("quant.range_alignment=max")
    with pytest.raises(ValueError, match="delayed_amax needs range_alignment='amax'"):
        eden_posthoc("quant.delayed_amax=true", "quant.range_alignment=posthoc")
    nvidia = train.scheme_from_config(compose_train(["quant=nvidia", "quant.range_alignment=amax"]).quant)
    assert nvidia == quant.SCHEMES["nvidia"]  # no MS-EDEN operand: nothing changes


def test_keep_edge_blocks_keeps_those_blocks_in_high_precision(compose_train):
    cfg = compose_train(["model=100m", "quant=nvidia", "quant.keep_edge_blocks={first: 1, last: 2}"])
    model = build_model(cfg.model, device="meta")
    skip = train.skip_patterns(cfg.quant, cfg.model.n_layer)
    quant.quantize_model(model, train.scheme_from_config(cfg.quant), skip=skip)
    kept = {i for i, block in enumerate(model.blocks) if type(block.attn.qkv) is nn.Linear}
    assert kept == {0, cfg.model.n_layer - 2, cfg.model.n_layer - 1}
    assert all(isinstance(b.mlp.down, QuantLinear) for i, b in enumerate(model.blocks) if i not in kept)
