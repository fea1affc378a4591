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
from omegaconf import OmegaConf
from torch import nn

import quant
from model import build_model
from quant import QuantLinear
from training import identity  # noqa: F401  (registers the run-name resolvers of train.yaml)

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
    scheme = quant.scheme_from_config(cfg.quant)
    quant.quantize_model(model, scheme, skip=quant.skip_patterns(cfg.quant, cfg.model.n_layer))

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


def test_ablation_switches_that_change_the_scheme_name_the_run(compose_train):
    """Two ablations of one scheme get two run directories (a sweep over a switch must not
    resume one run's checkpoint in the other); a switch set to what the scheme already does, or
    on bf16, leaves the name as it is. compare_runs reads the switches back as the report label."""
    from analysis.runs import Run, apply_name

    base = ["quant=quartet2", "model=30m", "train.tokens_per_param=1"]
    energy = compose_train([*base, "quant.eden_correction=energy", "quant.rotation=64"])
    assert energy.run_name == "30m-quartet2+rotation=64+eden_correction=energy-1tpp-s0"
    assert energy.run_group == "30m-1tpp"  # compared within the same group as the plain scheme
    for same in ("quant.four_over_six=true", "quant.range_alignment=posthoc", "quant.eden_correction=chunk_scaled"):
        assert compose_train([*base, same]).run_name == "30m-quartet2-1tpp-s0", same
    assert compose_train(["quant=bf16", "quant.rotation=64"]).run_name == "tiny-bf16-300steps-s0"
    delayed = compose_train(["quant=nvidia", "quant.delayed_amax=true"])
    assert delayed.run_name == "tiny-nvidia+delayed_amax=True-300steps-s0"
    run = Run(name=energy.run_name, source="dir", path="x")
    apply_name(run, run.name)
    assert (run.model, run.scheme, run.seed, run.tokens_per_param_cfg) == (
        "30m", "quartet2[rotation=64,eden_correction=energy]", 0, 1.0)


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
    assert set(cfg.quant) == {"name", *quant.ABLATIONS, *quant.LAYER_KEYS}
    # With every ablation switch at its default, the preset is exactly the library's scheme.
    assert quant.scheme_from_config(cfg.quant) == quant.SCHEMES[quant_name]
    assert list(cfg.quant.skip) == ["lm_head"]


def test_shared_switches_are_the_library_defaults():
    """configs/quant/base/switches.yaml, which every preset includes, sets each ablation switch of
    ``quant.get_scheme`` to its default, so a preset that names a scheme is that scheme."""
    shared = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "quant" / "base" / "switches.yaml"))
    assert set(shared) == {"name", *quant.ABLATIONS, *quant.LAYER_KEYS}
    assert {k: shared[k] for k in quant.ABLATIONS} == quant.ABLATIONS
    assert shared["name"] == "???"  # each preset names its scheme


def _ops(*gemms: quant.Gemm) -> list[quant.Operand]:
    return [o for g in gemms for o in (g.a, g.b)]


def _check_switch(switch: str, value, base: quant.Scheme, s: quant.Scheme) -> None:
    """Asserts that ``s``, built with ``quant.<switch>=<value>``, shows the switch against ``base``."""
    if switch == "forward":
        assert not s.forward.quantized and (s.dgrad, s.wgrad) == (base.dgrad, base.wgrad)
    elif switch == "backward":
        assert not s.dgrad.quantized and not s.wgrad.quantized
        assert s.dgrad.rotation is None and s.wgrad.rotation is None and s.forward == base.forward
    elif switch == "rotation":
        for g in ("dgrad", "wgrad"):
            assert getattr(s, g).rotation == (value if getattr(base, g).rotation else None)
        assert s.forward == base.forward
    elif switch == "four_over_six":
        assert all(o.four_over_six is value for o in _ops(s.forward) if o.quantizer in ("rtn", "rtn_2d"))
        assert (s.dgrad, s.wgrad) == (base.dgrad, base.wgrad)
    elif switch == "sr_four_over_six":
        assert all(o.four_over_six for o in _ops(s.dgrad, s.wgrad) if o.quantizer == "sr")
        assert s.forward == base.forward
    elif switch == "delayed_amax":
        assert s.delayed_amax and not base.delayed_amax
        assert not any(o.posthoc for o in _ops(s.dgrad, s.wgrad))  # delayed amax needs an amax pass
    elif switch == "range_alignment":
        assert all(o.posthoc is (value == "posthoc") for o in _ops(s.dgrad, s.wgrad) if o.quantizer == "ms_eden")
    elif switch == "eden_correction":
        eden = [o for o in _ops(s.dgrad, s.wgrad) if o.quantizer == "ms_eden"]
        assert all(o.eden_correction == value for o in eden)
        assert s.forward == base.forward
    else:
        raise AssertionError(f"no check for the switch {switch!r}")


# Every ablation switch of quant.get_scheme (test_switch_table_is_complete) with values off its default.
SWITCHES = [("forward", False), ("backward", False), ("rotation", 64), ("four_over_six", True),
            ("four_over_six", False), ("sr_four_over_six", True), ("delayed_amax", True),
            ("range_alignment", "amax"), ("eden_correction", "energy")]


def test_switch_table_is_complete():
    assert {switch for switch, _ in SWITCHES} == set(quant.ABLATIONS)


@pytest.mark.parametrize(("switch", "value"), SWITCHES)
def test_every_switch_reaches_every_scheme(compose_train, switch, value):
    """Each scheme composed with ``quant.<switch>=<value>``: the built scheme shows the switch, and
    it changes at least one scheme (a switch that never arrives would leave every one as it is)."""
    changed = []
    for name in QUANTS:
        s = quant.scheme_from_config(compose_train([f"quant={name}", f"quant.{switch}={value}"]).quant)
        base = quant.SCHEMES[name]
        _check_switch(switch, value, base, s)
        assert s.is_identity == base.is_identity
        if s != base:
            changed.append(name)
    assert changed, f"quant.{switch}={value} changed no scheme"


def test_switch_values_are_checked(compose_train):
    def build(*overrides: str) -> quant.Scheme:
        return quant.scheme_from_config(compose_train(["quant=quartet2", *overrides]).quant)

    with pytest.raises(ValueError, match="range_alignment"):
        build("quant.range_alignment=max")
    with pytest.raises(ValueError, match="delayed_amax needs range_alignment='amax'"):
        build("quant.delayed_amax=true", "quant.range_alignment=posthoc")
    with pytest.raises(ValueError, match="rotation size 48"):
        build("quant.rotation=48")


def test_unknown_quant_key_is_refused_naming_it_and_the_accepted_ones(compose_train):
    cfg = compose_train(["quant=nvidia", "+quant.rotaton=64"])  # composes: the key was added on purpose
    with pytest.raises(ValueError, match=r"'rotaton'.*accepted: name, forward, backward, rotation"):
        quant.scheme_from_config(cfg.quant)


def test_keep_edge_blocks_keeps_those_blocks_in_high_precision(compose_train):
    cfg = compose_train(["model=100m", "quant=nvidia", "quant.keep_edge_blocks={first: 1, last: 2}"])
    model = build_model(cfg.model, device="meta")
    skip = quant.skip_patterns(cfg.quant, cfg.model.n_layer)
    quant.quantize_model(model, quant.scheme_from_config(cfg.quant), skip=skip)
    kept = {i for i, block in enumerate(model.blocks) if type(block.attn.qkv) is nn.Linear}
    assert kept == {0, cfg.model.n_layer - 2, cfg.model.n_layer - 1}
    assert all(isinstance(b.mlp.down, QuantLinear) for i, b in enumerate(model.blocks) if i not in kept)
