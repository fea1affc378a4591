"""Precision recipes (quant/recipe.py), the late switch to BF16 (training/precision_schedule.py)
and validation in BF16 (training/validation.py): rule matching, the old layer choices as rules,
tiny CPU runs with a switch (losses, gradients, resume across the switch), ``val/loss_bf16`` and
its live gap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import checkpoint_state, interrupt, read_metrics
from torch import nn

import quant
from data.loader import val_batches
from data.prepare import prepare_from_config
from model import build_model
from quant import QuantLinear, get_scheme
from quant.recipe import (
    Recipe,
    RecipeError,
    Rule,
    bf16_linears,
    block_indices,
    quantize_with_recipe,
    recipe_from_config,
    scheme_for,
    set_precision,
    tail_blocks,
)
from quant.step_weights import quantized_once
from training import trainer
from training.errors import ConfigError
from training.precision_schedule import PrecisionSwitch, switch_from_config
from training.step import TrainStep

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# ----------------------------------------------------------------------------- rules


def test_block_ranges_count_from_both_ends():
    assert block_indices("-2..", 12) == [10, 11]
    assert block_indices("..1,-8..", 12) == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11]  # NVIDIA's first 2, last 8
    assert block_indices("3", 12) == [3] and block_indices("-1", 12) == [11]
    assert block_indices("2..4", 12) == [2, 3, 4] and block_indices("4..2", 12) == []
    for bad, why in (("12", "does not exist"), ("-13..", "does not exist"), ("..", "is not i"), ("a", "is not i")):
        with pytest.raises(RecipeError, match=why):
            block_indices(bad, 12)


def test_first_matching_rule_wins():
    recipe = Recipe([Rule("blocks.{-2..}.*", "bf16"), Rule("blocks.*.attn.*", "bf16_forward"),
                     Rule("blocks.{0}.mlp.down", "bf16_backward")], n_blocks=6)
    assert recipe.precision_of("blocks.5.attn.qkv") == "bf16"  # the tail rule comes first
    assert recipe.precision_of("blocks.3.attn.proj") == "bf16_forward"
    assert recipe.precision_of("blocks.0.mlp.down") == "bf16_backward"
    assert recipe.precision_of("blocks.1.mlp.down") == "scheme"  # no rule: the scheme
    assert recipe.precision_of("blocks.10.attn.qkv") == "bf16_forward"  # {..} is a number, not a prefix


def test_bf16_tail_as_blocks_or_fraction():
    assert tail_blocks(2, 12) == 2 and tail_blocks(0, 12) == 0
    assert tail_blocks(0.15, 12) == 2  # 1.8 blocks, rounded up
    assert tail_blocks(0.25, 12) == 3 and tail_blocks(1.0, 12) == 12
    for bad in (13, -1, 0.0, 1.5, True, "2"):
        with pytest.raises(RecipeError, match="bf16_tail"):
            tail_blocks(bad, 12)
    recipe = recipe_from_config({"bf16_tail": 0.15, "skip": []}, 12)
    assert [recipe.precision_of(f"blocks.{i}.mlp.up_gate") for i in (9, 10, 11)] == ["scheme", "bf16", "bf16"]


def test_bad_rules_name_the_problem_and_the_fix(compose_train):
    with pytest.raises(RecipeError, match=r"quant.recipe\[0\]: unknown precision 'fp8'.*bf16_forward"):
        recipe_from_config({"recipe": [{"modules": "lm_head", "precision": "fp8"}]}, 2)
    with pytest.raises(RecipeError, match=r"quant.recipe\[0\]=.*must be \{modules"):
        recipe_from_config({"recipe": [{"module": "lm_head", "precision": "bf16"}]}, 2)
    model = build_model(compose_train([]).model, device="meta")
    recipe = recipe_from_config({"recipe": [{"modules": "blocks.*.attention.*", "precision": "bf16"}]}, 2)
    with pytest.raises(RecipeError, match=r"'blocks.\*.attention.\*' matches no linear layer.*blocks.0.attn.qkv.*Fix"):
        quantize_with_recipe(model, get_scheme("quartet2"), recipe)
    with pytest.raises(RecipeError, match=r"block 5 does not exist in a model of 2 blocks"):
        recipe_from_config({"recipe": [{"modules": "blocks.{5}.*", "precision": "bf16"}]}, 2)
    with pytest.raises(RecipeError, match=r"^quant.skip: block range \{5\.\.\}: block 5 does not exist"):
        recipe_from_config({"skip": ["lm_head", "blocks.{5..}.*"]}, 2)


def _layers(model: nn.Module) -> dict[str, tuple[int, quant.Scheme]]:
    return {m.layer_name: (m.layer_index, m.scheme) for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("overrides", [
    [], ["quant.skip=[]"], ["quant.skip=null"], ["quant.keep_edge_blocks={first: 1, last: 2}"],
    ["quant=nvidia", "quant.skip=[lm_head,blocks.3.*]", "quant.keep_edge_blocks={first: 2, last: 8}"],
    ["quant=bf16"],
])
def test_skip_and_keep_edge_blocks_quantize_the_same_layers_as_before(compose_train, overrides):
    """The old layer choice (quantize_model with skip_patterns) and the recipe give the same
    quantized layers, with the same layer indices (the randomness key) and schemes."""
    cfg = compose_train(["model=100m", *overrides])
    scheme = quant.scheme_from_config(cfg.quant)
    old, new = build_model(cfg.model, device="meta"), build_model(cfg.model, device="meta")
    quant.quantize_model(old, scheme, skip=quant.skip_patterns(cfg.quant, cfg.model.n_layer, scheme.skip))
    quantize_with_recipe(new, scheme, recipe_from_config(cfg.quant, cfg.model.n_layer, scheme.skip))
    assert _layers(new) == _layers(old)
    assert [n for n, m in new.named_modules() if type(m) is nn.Linear] == \
        [n for n, m in old.named_modules() if type(m) is nn.Linear]


def test_recipe_rules_give_each_layer_its_gemms(compose_train):
    cfg = compose_train(["model=100m", "quant=nvidia", "quant.bf16_tail=2",
                         "quant.recipe=[{modules: 'blocks.*.attn.*', precision: bf16_forward},"
                         "{modules: 'blocks.{0}.*', precision: bf16_backward}]"])
    n, scheme = cfg.model.n_layer, quant.scheme_from_config(cfg.quant)
    model = build_model(cfg.model, device="meta")
    quantize_with_recipe(model, scheme, recipe_from_config(cfg.quant, n, scheme.skip))
    layers = _layers(model)
    assert not any(name.startswith((f"blocks.{n - 1}.", f"blocks.{n - 2}.")) for name in layers)  # the tail
    assert layers["blocks.3.attn.qkv"][1] == get_scheme("nvidia", forward=False)
    assert layers["blocks.0.mlp.down"][1] == get_scheme("nvidia", backward=False)
    assert layers["blocks.0.attn.qkv"][1] == get_scheme("nvidia", forward=False)  # the earlier rule wins
    assert layers["blocks.3.mlp.down"][1] == scheme
    assert sorted(i for i, _ in layers.values()) == list(range(len(layers)))


def test_quantized_once_skips_layers_whose_forward_is_bf16(compose_train):
    cfg = compose_train(["quant=nvidia", "quant.recipe=[{modules: 'blocks.*.attn.*', precision: bf16_forward}]"])
    model = build_model(cfg.model, device="cpu")
    scheme = quant.scheme_from_config(cfg.quant)
    quantize_with_recipe(model, scheme, recipe_from_config(cfg.quant, cfg.model.n_layer, scheme.skip))
    with quantized_once(model) as cached:
        assert cached == 2 * cfg.model.n_layer  # the MLP linears only
    assert set_precision(model, "bf16_forward") == 2 * cfg.model.n_layer
    with quantized_once(model) as cached:
        assert cached == 0


def test_forward_bf16_keeps_the_backward_quantized():
    """bf16_forward: the forward equals the all-BF16 layer's bit for bit, the gradients are the
    scheme's backward on the BF16 forward's operands: never all-BF16's, and the quantized layer's
    only where the backward does not read the forward's quantized operands (nvidia's wgrad
    quantizes the high-precision X; its dgrad reads Ŵ, quartet2's both GEMMs re-quantize the
    forward's X̂ and Ŵ)."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 128), torch.randn(128, 128)
    out = {}
    for name in ("nvidia", "quartet2"):
        for precision in ("scheme", "bf16_forward", "bf16"):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            quant.randomness.set_quant_step(0, 0)
            y = quant.quantized_linear(xi, wi, scheme_for(get_scheme(name), precision), 3)
            (y * torch.linspace(-1, 1, 128)).sum().backward()
            out[name, precision] = (y.detach(), xi.grad, wi.grad)
        assert torch.equal(out[name, "bf16_forward"][0], out[name, "bf16"][0])
        assert torch.equal(out[name, "bf16"][0], x @ w.t())
        assert not torch.equal(out[name, "scheme"][0], out[name, "bf16"][0])
        for g in (1, 2):
            assert not torch.equal(out[name, "bf16_forward"][g], out[name, "bf16"][g]), (name, g)
        assert not torch.equal(out[name, "bf16_forward"][1], out[name, "scheme"][1]), name
        assert torch.equal(out[name, "bf16_forward"][2], out[name, "scheme"][2]) is (name == "nvidia")


def test_compiled_layer_follows_a_switch_of_its_scheme():
    """torch.compile guards on the layer's scheme: after a switch the compiled layer computes the
    new scheme (one recompile), and switching back reuses the first graph."""
    torch.manual_seed(0)
    layer = QuantLinear(128, 128, scheme=get_scheme("nvidia"), layer_index=0, name="l")
    compiled, x = torch.compile(layer, backend="eager"), torch.randn(16, 128)
    with torch.no_grad():
        quantized = compiled(x)
        assert torch.equal(quantized, layer(x))
        set_precision(layer, "bf16_forward")
        assert torch.equal(compiled(x), x @ layer.weight.t())
        with bf16_linears(layer):
            assert torch.equal(compiled(x), x @ layer.weight.t())
        assert layer.scheme == get_scheme("nvidia", forward=False)


# ----------------------------------------------------------------------------- the schedule


def test_switch_point_from_step_or_fraction():
    assert switch_from_config({"schedule": {"at": None}}, 100) is None
    assert switch_from_config({"schedule": {"at": 0.8, "precision": "bf16_forward"}}, 100) == \
        PrecisionSwitch(80, "bf16_forward")
    assert switch_from_config({"schedule": {"at": 0.7, "precision": "bf16"}}, 10) == PrecisionSwitch(7, "bf16")
    assert switch_from_config({"schedule": {"at": 99, "precision": "bf16"}}, 100).step == 99
    for at in (0, 100, 1.0, 0.0, 0.001, "late"):
        with pytest.raises(ConfigError, match=r"quant.schedule.at=.*Fix: quant.schedule.at=S with 1 ≤ S ≤ 99"):
            switch_from_config({"schedule": {"at": at, "precision": "bf16"}}, 100)
    with pytest.raises(ConfigError, match=r"quant.schedule.precision='fp8'.*bf16_forward, bf16"):
        switch_from_config({"schedule": {"at": 50, "precision": "fp8"}}, 100)


def test_run_name_shows_the_recipe_and_the_group_stays(compose_train):
    from analysis.runs import Run, apply_name

    base = ["quant=quartet2", "model=30m", "train.tokens_per_param=1"]
    plain = compose_train(base)
    switched = compose_train([*base, "quant.schedule.at=0.8", "quant.bf16_tail=2"])
    assert switched.run_name == "30m-quartet2+tail=2+fwdbf16@80%-1tpp-s0"
    assert switched.run_group == plain.run_group == "30m-1tpp"
    assert compose_train([*base, "quant.schedule.at=500", "quant.schedule.precision=bf16"]).run_name == \
        "30m-quartet2+bf16@500-1tpp-s0"
    assert compose_train([*base, "quant.bf16_tail=0.15"]).run_name == "30m-quartet2+tail=15%-1tpp-s0"
    ruled = compose_train([*base, "quant.recipe=[{modules: 'blocks.*.attn.*', precision: bf16}]"]).run_name
    assert ruled.startswith("30m-quartet2+recipe=") and ruled != plain.run_name
    assert compose_train(["quant=bf16", "quant.schedule.at=5"]).run_name == "tiny-bf16-300steps-s0"
    run = Run(name=switched.run_name, source="dir", path="x")
    apply_name(run, run.name)
    assert (run.model, run.scheme, run.seed) == ("30m", "quartet2[tail=2,fwdbf16@80%]", 0)


def _told(m: pytest.MonkeyPatch) -> list[int]:
    """Records, at each call of TrainStep.precision_changed, how many steps the step had run."""
    told: list[int] = []
    real = TrainStep.precision_changed

    def record(self: TrainStep) -> None:
        told.append(self.calls)
        real(self)

    m.setattr(TrainStep, "precision_changed", record)
    return told


@pytest.mark.parametrize("override,message", [
    ("quant.schedule.at=300", r"quant.schedule.at=300: step 300, outside the run's 300 steps.*Fix"),
    ("quant.schedule.precision=nvidia", r"quant.schedule.precision='nvidia' is not a switch target"),
    ("quant.bf16_tail=3", r"quant.bf16_tail=3: the model has 2 blocks"),
    ("train.eval_bf16=maybe", r"train.eval_bf16=maybe must be auto"),
])
def test_bad_settings_stop_the_run_before_it_trains(tiny, override, message):
    cfg = tiny(override, "quant.schedule.at=100" if "precision" in override else "train.steps=300")
    with pytest.raises(ValueError, match=message):
        trainer.run(cfg)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()


SWITCH = ["quant=nvidia", "train.steps=4", "train.ckpt_every=1", "train.eval_every=2"]


def _curve(run_dir) -> list[tuple]:
    return [(s, r.get("train/loss"), r.get("train/grad_norm"), r.get("val/loss"))
            for s, r in sorted(read_metrics(run_dir).items())]


def test_switch_changes_the_run_from_its_step_on(tiny, monkeypatch):
    """A switch at step 2 of 4: the losses equal the unswitched run's through step 2 and differ
    after; the forward-only and the full switch give the same loss at the switch step (both
    forwards are BF16) but different gradients; the step is told once, at the switch."""
    told = _told(monkeypatch)
    runs, dirs = {}, {}
    for name, extra in (("plain", []), ("forward", ["quant.schedule.at=2"]),
                        ("all", ["quant.schedule.at=0.5", "quant.schedule.precision=bf16"])):
        cfg = tiny(*SWITCH, *extra, "train.eval_every=1000", "train.ckpt_every=1000", run=name)
        trainer.run(cfg)
        runs[name], dirs[name] = read_metrics(cfg.run_dir), Path(cfg.run_dir)
    assert told == [2, 2]  # the calls before the step that switched
    plain, forward, full = runs["plain"], runs["forward"], runs["all"]
    for s in (1, 2):
        assert forward[s]["train/loss"] == plain[s]["train/loss"] == full[s]["train/loss"]
    assert forward[3]["train/loss"] == full[3]["train/loss"] != plain[3]["train/loss"]
    assert len({forward[3]["train/grad_norm"], full[3]["train/grad_norm"], plain[3]["train/grad_norm"]}) == 3
    assert forward[4]["train/loss"] != full[4]["train/loss"]
    assert "switch to bf16_forward (quant.schedule.at=2, from step 2 on)" in (dirs["forward"] / "train.log").read_text()


def test_resume_across_the_switch_is_bit_exact(tiny, monkeypatch):
    """A switch at step 2 of 4; a run stopped before it (after step 1) and after it (after step
    3), resumed each time: every loss, gradient norm and validation loss equals the straight
    run's, and the run resumed past the switch is switched before its first step. A checkpoint
    of another switch point is refused."""
    switch = [*SWITCH, "quant.schedule.at=2"]
    straight = tiny(*switch, run="straight")
    trainer.run(straight)
    cfg = tiny(*switch, run="stopped")
    told = []
    for stop in (1, 3, None):
        with monkeypatch.context() as m:
            told.append(_told(m))
            if stop is None:
                trainer.run(cfg)
                continue
            with pytest.raises(interrupt("ctrl_c", stop, m, Path(cfg.run_dir))):
                trainer.run(cfg)
    assert told == [[], [1], [0]]  # resumed at step 1: after one step; at step 3: before the first
    assert _curve(cfg.run_dir) == _curve(straight.run_dir)
    with pytest.raises(ValueError, match=r"quant.schedule.at: 2 in the checkpoint, 3 now"):
        trainer.run(tiny(*SWITCH, "quant.schedule.at=3", run="stopped"))


# ----------------------------------------------------------------------------- validation in BF16


def _bf16_val_loss(cfg, state: dict) -> float:
    """The validation loss of ``state``'s weights in the unquantized model (every linear an
    nn.Linear), over the trainer's validation batches."""
    model = build_model(cfg.model, device="cpu")
    model.load_state_dict(state)
    model.eval()
    t = cfg.train
    with torch.no_grad():
        losses = [model(x, y).float() for x, y in val_batches(prepare_from_config(cfg.data), t.seq_len,
                                                               t.eval_batch_size, t.eval_batches)]
    return torch.stack(losses).mean().item()


def test_quantized_run_validates_in_bf16_too_and_gaps_both(tiny, tmp_path):
    """A bf16 baseline and a switched nvidia run in one run_root: the quantized run logs
    val/loss_bf16 at every validation, equal to the unquantized model's loss on its weights, and
    the live gap of both losses against the same baseline (its recipe keys are not matched)."""
    common = ["train.steps=4", "train.eval_every=2", "train.ckpt_every=4"]
    base = tiny("quant=bf16", *common, run="bf16")
    trainer.run(base)
    assert not any("val/loss_bf16" in r for r in read_metrics(base.run_dir).values())  # auto: off for bf16
    cfg = tiny("quant=nvidia", "quant.schedule.at=2", "quant.bf16_tail=1", *common, run="q")
    summary = trainer.run(cfg)
    rows, base_rows = read_metrics(cfg.run_dir), read_metrics(base.run_dir)
    assert rows[2]["val/loss_bf16"] != rows[2]["val/loss"]
    assert rows[4]["val/loss_bf16"] == rows[4]["val/loss"]  # switched: every forward GEMM is BF16
    for s in (0, 2, 4):
        assert rows[s]["val/loss_gap"] == rows[s]["val/loss"] - base_rows[s]["val/loss"]
        assert rows[s]["val/loss_gap_bf16"] == rows[s]["val/loss_bf16"] - base_rows[s]["val/loss"]
    assert summary["final_val_loss_bf16"] == rows[4]["val/loss_bf16"]
    assert summary["loss_gap_bf16"] == rows[4]["val/loss_gap_bf16"] and summary["loss_gap"] == rows[4]["val/loss_gap"]
    state = checkpoint_state(Path(cfg.run_dir) / "checkpoints" / "step_00000004", tmp_path / "q.pt")["model"]
    assert _bf16_val_loss(cfg, state) == pytest.approx(rows[4]["val/loss_bf16"], rel=1e-6)
