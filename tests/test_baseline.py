"""The live loss gap (training/baseline.py): baseline discovery, its refusal, late baselines, and
the gap a quantized run logs against a bf16 run it finds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import trainer
from training.baseline import CONFIG_FILE, BaselineError, LiveGap

BASE_CFG = {"model": {"name": "tiny", "n_layer": 2, "d_model": 64}, "quant": {"name": "bf16"}, "seed": 0,
            "data": {"name": "sample"},
            "train": {"steps": 6, "tokens_per_param": None, "batch_size": 8, "seq_len": 128}}


def cfg_of(scheme: str, root: Path, **changes) -> dict:
    cfg = json.loads(json.dumps(BASE_CFG))
    cfg["quant"]["name"] = scheme
    cfg["run_root"] = str(root)
    for dotted, value in changes.items():
        node = cfg
        *path, last = dotted.split("__")
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


def fake_run(root: Path, name: str, cfg: dict, val: dict[int, float]) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / CONFIG_FILE).write_text(json.dumps(cfg))
    add_vals(d, val)
    return d


def add_vals(run_dir: Path, val: dict[int, float]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step, loss in val.items():
            f.write(json.dumps({"step": step, "val/loss": loss}) + "\n")


def test_auto_finds_the_matching_bf16_run_and_logs_each_gap(tmp_path):
    base = fake_run(tmp_path, "tiny-bf16", cfg_of("bf16", tmp_path), {0: 8.0, 3: 6.0, 6: 5.0})
    fake_run(tmp_path / "other", "tiny-bf16-s1", cfg_of("bf16", tmp_path, seed=1), {0: 1.0, 3: 1.0})
    gaps = LiveGap(cfg_of("quartet2", tmp_path), tmp_path / "q")
    assert str(base) in gaps.line and "same model, data, budget, batch, seed" in gaps.line
    rows = [gaps.at_validation(s, v)[0] for s, v in ((0, 8.0), (3, 6.25), (6, 5.5))]
    assert rows == [{"gap_step": 0, "val/loss_gap": 0.0, "val/loss_gap_rel": 0.0},
                    {"gap_step": 3, "val/loss_gap": 0.25, "val/loss_gap_rel": 0.25 / 6.0},
                    {"gap_step": 6, "val/loss_gap": 0.5, "val/loss_gap_rel": 0.1}]
    assert gaps.remaining() == [] and gaps.missing() == [] and gaps.final(6) == 0.5


@pytest.mark.parametrize("change", [
    {"model__n_layer": 3}, {"data__name": "c4"}, {"train__steps": 8}, {"train__batch_size": 16},
    {"train__seq_len": 64}, {"seed": 1},
], ids=["model", "data", "budget", "batch", "seq_len", "seed"])
def test_a_bf16_run_that_differs_is_not_a_baseline(tmp_path, change):
    other = fake_run(tmp_path, "bf16-other", cfg_of("bf16", tmp_path, **change), {0: 8.0})
    gaps = LiveGap(cfg_of("quartet2", tmp_path), tmp_path / "q")
    assert gaps.baseline is None
    assert "none yet, no bf16 run with the same model, data, budget, batch and seed" in gaps.line
    assert gaps.at_validation(0, 8.0) == ({}, None)
    key = next(iter(change)).replace("__", ".")
    with pytest.raises(BaselineError, match=rf"not comparable .*{key}: .* here, .* there.*Fix"):
        LiveGap({**cfg_of("quartet2", tmp_path), "baseline": str(other)}, tmp_path / "q")


def test_named_baseline_must_be_bf16_and_exist(tmp_path):
    nv = fake_run(tmp_path, "nvidia", cfg_of("nvidia", tmp_path), {0: 8.0})
    with pytest.raises(BaselineError, match="is a nvidia run, not bf16"):
        LiveGap({**cfg_of("quartet2", tmp_path), "baseline": str(nv)}, tmp_path / "q")
    with pytest.raises(BaselineError, match="neither a run directory nor a W&B run"):
        LiveGap({**cfg_of("quartet2", tmp_path), "baseline": str(tmp_path / "missing")}, tmp_path / "q")
    off = LiveGap({**cfg_of("quartet2", tmp_path), "baseline": None}, tmp_path / "q")
    assert "off (baseline=null)" in off.line and off.at_validation(0, 1.0) == ({}, None)


def test_late_baseline_gaps_come_later_in_order_and_are_never_interpolated(tmp_path):
    """The baseline runs beside this run: a step it has not reached gets its gap at a later
    validation (the oldest first, one per row) or at the end; a step it never validated has none."""
    gaps = LiveGap(cfg_of("quartet2", tmp_path), tmp_path / "q")
    assert gaps.baseline is None and "looked for again at each validation" in gaps.line
    assert gaps.at_validation(0, 8.0) == ({}, None)  # no baseline yet
    base = fake_run(tmp_path, "bf16", cfg_of("bf16", tmp_path), {0: 8.0})
    row, found = gaps.at_validation(2, 7.0)
    assert found and str(base) in found and row["gap_step"] == 0
    add_vals(base, {2: 6.5, 3: 6.0})
    assert gaps.at_validation(4, 6.0)[0]["gap_step"] == 2
    assert gaps.at_validation(5, 5.5) == ({}, None)  # the baseline has reached neither 4 nor 5
    add_vals(base, {4: 5.0, 6: 4.0})
    assert [r["gap_step"] for r in gaps.remaining()] == [4]  # the end of the run
    assert gaps.missing() == [5]  # the baseline validated 4 and 6, never 5: no gap there
    assert gaps.final(5) is None


def test_quantized_run_logs_its_gap_against_the_bf16_run(tiny):
    """Two real runs: bf16, then quartet2 with the same settings; quartet2's validation rows carry
    the gap to bf16's losses at the same steps, and its summary the final one."""
    common = ["train.steps=4", "train.eval_every=2", "train.ckpt_every=100"]
    base_cfg = tiny("quant=bf16", *common, run="tiny-bf16")
    trainer.run(base_cfg)
    cfg = tiny("quant=quartet2", *common, run="tiny-quartet2")
    summary = trainer.run(cfg)
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    base = {r["step"]: r["val/loss"] for r in map(json.loads, (Path(base_cfg.run_dir) / "metrics.jsonl")
                                                   .read_text().splitlines()) if "val/loss" in r}
    gap_rows = [r for r in rows if "val/loss_gap" in r]
    assert [r["gap_step"] for r in gap_rows] == [0, 2, 4] and all(r["step"] == r["gap_step"] for r in gap_rows)
    for r in gap_rows:
        assert r["val/loss_gap"] == r["val/loss"] - base[r["step"]]
        assert r["val/loss_gap_rel"] == pytest.approx(r["val/loss_gap"] / base[r["step"]], rel=1e-12)
    assert summary["loss_gap"] == gap_rows[-1]["val/loss_gap"]
    log = (Path(cfg.run_dir) / "train.log").read_text().splitlines()
    assert f"loss gap against the bf16 run {base_cfg.run_dir}" in log[1]
    assert "loss gap: none (this run is the bf16 baseline)" in (Path(base_cfg.run_dir) / "train.log").read_text()


class _ApiRun:
    def __init__(self, rid: str, config: dict, val: dict[int, float]):
        self.id, self.config, self._val = rid, config, val

    def scan_history(self, keys=None):
        return [{"_step": s, "val/loss": v} for s, v in self._val.items()]


class _Api:
    """The part of ``wandb.Api`` the baseline search uses."""

    def __init__(self, runs):
        self._runs = runs

    def runs(self, project, filters=None, order=None):
        assert project == "team/proj" and filters == {"config.quant.name": "bf16", "config.seed": 0}
        return list(self._runs)

    def run(self, path):
        return next(r for r in self._runs if path == f"team/proj/{r.id}")


def test_online_runs_find_their_baseline_in_the_wandb_project(tmp_path):
    other = _ApiRun("x1", cfg_of("bf16", tmp_path, train__batch_size=16), {0: 1.0})
    good = _ApiRun("b1", cfg_of("bf16", tmp_path), {0: 8.0, 3: 6.0})
    api = _Api([other, good])
    gaps = LiveGap(cfg_of("quartet2", tmp_path), tmp_path / "q", "team/proj", api_factory=lambda: api)
    assert "W&B run team/proj/b1" in gaps.line
    assert gaps.at_validation(3, 6.5)[0] == {"gap_step": 3, "val/loss_gap": 0.5, "val/loss_gap_rel": 0.5 / 6.0}
    named = LiveGap({**cfg_of("quartet2", tmp_path), "baseline": "team/proj/b1"}, tmp_path / "q",
                    api_factory=lambda: api)
    assert named.baseline.where == "W&B run team/proj/b1"
    with pytest.raises(BaselineError, match=r"team/proj/x1 is not comparable .*train\.batch_size: 8 here, 16 there"):
        LiveGap({**cfg_of("quartet2", tmp_path), "baseline": "team/proj/x1"}, tmp_path / "q", api_factory=lambda: api)


def test_no_baseline_anywhere_leaves_no_step_missing_and_the_run_says_so(tiny, tmp_path):
    """Without any bf16 run, no validation step counts as 'missing from the baseline': the run's
    last lines say that no baseline was found, not that one lacks values."""
    gaps = LiveGap(cfg_of("quartet2", tmp_path), tmp_path / "q")
    gaps.at_validation(0, 8.0)
    gaps.at_validation(6, 5.0)
    assert gaps.baseline is None and gaps.missing() == [] and gaps.remaining() == []
    cfg = tiny("quant=quartet2", "train.steps=2", "train.eval_every=1", run="alone")
    trainer.run(cfg)
    log = (Path(cfg.run_dir) / "train.log").read_text()
    assert "has no validation loss yet" not in log
    assert "loss gap: none, no bf16 baseline was found" in log


def test_every_metrics_row_names_the_step_its_values_belong_to(tmp_path):
    """metrics.jsonl's schema (training/tracking.py): a gap found at a later validation, or at the
    end of the run, is a row of its own step, so no row lacks ``step`` or carries another step's gap."""
    from training.tracking import Tracker

    tracker = Tracker(tmp_path, {}, "run", "group", {"enabled": False}, None, total_steps=60, start_step=0)
    tracker.log(0, {"val/loss": 8.0}, line=False)
    tracker.log(60, {"train/loss": 4.5, "val/loss": 4.6, "gap_step": 0, "val/loss_gap": 0.0026,
                     "val/loss_gap_rel": 0.0003}, line=False)
    tracker.log_after(60, [{"gap_step": 60, "val/loss_gap": 0.01, "val/loss_gap_rel": 0.002}])
    tracker.finish()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("step" in r for r in rows)
    assert all(r["step"] == r["gap_step"] for r in rows if "gap_step" in r)
    assert {"step": 60, "train/loss": 4.5, "val/loss": 4.6} in rows
    assert {"step": 0, "gap_step": 0, "val/loss_gap": 0.0026, "val/loss_gap_rel": 0.0003} in rows
    assert {"step": 60, "gap_step": 60, "val/loss_gap": 0.01, "val/loss_gap_rel": 0.002} in rows
