"""Tests of the run analysis (analysis/) and its command line scripts/compare_runs.py on hand-made
run folders: trainer-style run dirs (metrics.jsonl + summary.json + a config), with and without a
W&B run folder inside, W&B folders on their own (reported, never decoded), and a fake W&B API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import analysis
from scripts.compare_runs import main

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
P30 = 30_482_560  # SPEC §4 non-embedding parameters of 30m
P50 = 49_556_736
T25 = 25 * P30  # a 25 tokens/param budget of 30m (tokens as the trainer's summary gives them)
T100 = 100 * P30


def local_run(root: Path, name: str, *, model: str, scheme: str, seed: int, tokens: int | None,
              params: int, final: float | None, curve: dict[int, float], config: str = "hydra",
              tpp: float | None = None, quant_extra: dict | None = None) -> Path:
    """A trainer-like run dir: metrics.jsonl, summary.json (unless ``final`` is None), a config."""
    d = root / name
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for step in sorted(curve):
            f.write(json.dumps({"step": step, "train/loss": curve[step] + 0.1, "val/loss": curve[step]}) + "\n")
    if final is not None:
        (d / "summary.json").write_text(json.dumps({
            "final_val_loss": final, "steps": max(curve), "tokens": tokens, "non_embedding_params": params,
            "scheme": scheme, "model": model, "world_size": 1}))
    cfg = {"seed": seed, "model": {"name": model}, "quant": {"name": scheme, "sr_four_over_six": False,
                                                              **(quant_extra or {})},
           "train": {"tokens_per_param": tpp, "steps": 300}}
    if config == "hydra":
        (d / ".hydra").mkdir()
        import yaml

        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    elif config == "json":
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def wandb_folder(run_dir: Path, run_id: str, stamp: str = "20261202_010101") -> Path:
    """A W&B run folder as W&B names it (its contents are never read)."""
    folder = run_dir / "wandb" / f"offline-run-{stamp}-{run_id}"
    folder.mkdir(parents=True)
    (folder / f"run-{run_id}.wandb").write_bytes(b":W&B private")
    return folder


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    # 30m at 25 tokens/param: BF16 and NVIDIA with two seeds each (paired by seed).
    local_run(root, "30m-bf16-25tpp-s0", model="30m", scheme="bf16", seed=0, tokens=T25, params=P30, final=3.50,
              curve={100: 4.0, 200: 3.6, 300: 3.50})
    local_run(root, "30m-bf16-25tpp-s1", model="30m", scheme="bf16", seed=1, tokens=T25, params=P30, final=3.52,
              curve={100: 4.0, 200: 3.6, 300: 3.52}, config="json")
    local_run(root, "30m-nvidia-25tpp-s0", model="30m", scheme="nvidia", seed=0, tokens=T25, params=P30,
              final=3.56, curve={100: 4.1, 200: 3.65, 300: 3.56})
    local_run(root, "sub/30m-nvidia-25tpp-s1", model="30m", scheme="nvidia", seed=1, tokens=T25, params=P30,
              final=3.57, curve={100: 4.1, 200: 3.67, 300: 3.57}, config="none")
    # The biased control, labelled by its ablation switch, paired with the same BF16 runs.
    local_run(root, "ctrl", model="30m", scheme="nvidia", seed=0, tokens=T25, params=P30, final=3.60,
              curve={300: 3.60}, quant_extra={"sr_four_over_six": True})
    # Mismatched budgets: NVIDIA at 100 tokens/param has no BF16 run of that budget, and a run
    # 262,144 tokens off the 25 tokens/param budget must not pair with it either.
    local_run(root, "30m-nvidia-100tpp-s0", model="30m", scheme="nvidia", seed=0, tokens=T100, params=P30,
              final=3.30, curve={300: 3.30})
    local_run(root, "30m-tetrajet_v2-odd-s0", model="30m", scheme="tetrajet_v2", seed=0, tokens=T25 + 262_144,
              params=P30, final=3.55, curve={300: 3.55})
    # Missing baseline: no BF16 run of 50m at all.
    local_run(root, "50m-quartet2-25tpp-s0", model="50m", scheme="quartet2", seed=0, tokens=25 * P50, params=P50,
              final=3.40, curve={300: 3.40})
    # Unfinished: metrics but no summary.json.
    local_run(root, "30m-four_over_six-25tpp-s0", model="30m", scheme="four_over_six", seed=0, tokens=T25,
              params=P30, final=None, curve={100: 4.2})
    # quartet2 (seed 0), a run dir with its W&B folder inside (the trainer's layout) ...
    q2 = local_run(root, "30m-quartet2-25tpp-s0", model="30m", scheme="quartet2", seed=0, tokens=T25, params=P30,
                   final=3.545, curve={100: 4.05, 200: 3.62, 300: 3.545}, config="json")
    wandb_folder(q2, "q2run01")
    # ... and a W&B folder without its run dir: reported, not read.
    wandb_folder(root / "wandb_only", "orphan01")
    return root


@pytest.fixture(scope="module")
def report(runs_root):
    runs, notes = analysis.collect_paths([runs_root])
    return analysis.compare(runs, notes=notes)


def _row(rows, scheme, tokens=T25, model="30m"):
    found = [r for r in rows if r.scheme == scheme and r.tokens == tokens and r.model == model]
    assert len(found) == 1, [(r.model, r.scheme, r.tokens) for r in rows]
    return found[0]


def test_run_dirs_are_read_with_and_without_wandb_folders(report, runs_root):
    q2 = _row(report.rows, "quartet2")
    assert [(r.source, r.run_id) for r in q2.runs] == [("local", "q2run01")]  # the id from the folder name
    assert _row(report.rows, "bf16").runs[0].run_id is None  # no W&B folder: still read
    orphan = runs_root / "wandb_only" / "wandb" / "offline-run-20261202_010101-orphan01"
    assert any(str(orphan) in n and f"wandb sync {orphan}" in n and "--wandb ENTITY/PROJECT" in n
               for n in report.notes), report.notes
    with pytest.raises(analysis.CompareError, match="wandb sync"):
        analysis.collect_paths([orphan / "run-orphan01.wandb"])
    runs, notes = analysis.collect_paths([orphan])
    assert runs == [] and "private format" in notes[0]


def test_gaps_are_paired_by_seed_and_averaged(report):
    nv = _row(report.rows, "nvidia")
    assert nv.n == 2 and nv.paired
    assert nv.gap == pytest.approx(((3.56 - 3.50) + (3.57 - 3.52)) / 2)
    assert nv.gap_sd == pytest.approx(((0.06 - 0.055) ** 2 * 2) ** 0.5)
    assert nv.baseline_loss == pytest.approx(3.51) and nv.final_loss == pytest.approx(3.565)
    assert nv.tokens_per_param == pytest.approx(25.0) and nv.params == P30
    q2 = _row(report.rows, "quartet2")
    assert q2.n == 1 and q2.gap == pytest.approx(3.545 - 3.50)
    ctrl = _row(report.rows, "nvidia[sr_four_over_six=True]")
    assert ctrl.gap == pytest.approx(0.10)
    base = _row(report.rows, "bf16")
    assert base.gap is None and base.n == 2


def test_gap_along_training_at_common_steps(report):
    nv = _row(report.rows, "nvidia")
    assert nv.curve == pytest.approx({100: 0.1, 200: (0.05 + 0.07) / 2, 300: 0.055})
    q2 = _row(report.rows, "quartet2")
    assert q2.curve == pytest.approx({100: 0.05, 200: 0.02, 300: 0.045})


def test_mismatched_budgets_and_missing_baselines_are_listed_not_paired(report):
    unmatched = {(r.model, r.scheme, r.tokens) for r in report.unmatched}
    assert unmatched == {("30m", "nvidia", T100), ("30m", "tetrajet_v2", T25 + 262_144), ("50m", "quartet2", 25 * P50)}
    assert all(r.gap is None for r in report.unmatched)
    assert {(r.scheme, r.tokens) for r in report.rows} == {
        ("bf16", T25), ("nvidia", T25), ("nvidia[sr_four_over_six=True]", T25), ("quartet2", T25)}
    assert [r.name for r in report.incomplete] == ["30m-four_over_six-25tpp-s0"]


def test_markdown_has_the_sections(report):
    text = analysis.markdown(report)
    assert "| 30m | 30,482,560 | 762,064,000 | 25 | nvidia | 3.5650 | 3.5100 | +0.0550 ± 0.0071 | 2 |" in text
    assert "| 30m | 30,482,560 | 762,064,000 | 25 | quartet2 | 3.5450 | 3.5000 | +0.0450 | 1 |" in text
    section = text.split("## Runs without a matching bf16 baseline")[1].split("##")[0]
    assert "50m-quartet2-25tpp-s0" in section and "30m-nvidia-100tpp-s0" in section
    assert "## Runs without a final validation loss" in text
    assert "### Loss gap to bf16, 30m" in text and "| 25 | +0.0550 | +0.1000 | +0.0450 |" in text


def test_plots_are_written(report, tmp_path):
    gap = analysis.plot_gaps(report, tmp_path / "gap.png")
    curves = analysis.plot_curves(report, tmp_path / "curves.png")
    for p in (gap, curves):
        data = p.read_bytes()
        assert data[:8] == PNG and len(data) > 5000


def test_cli_end_to_end(runs_root, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main([str(runs_root), "--plot", str(out / "gap.png"), "--curves", str(out / "curves.png"),
               "--out", str(out / "report.md"), "--json", str(out / "report.json"), "--writeback"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert (out / "gap.png").read_bytes()[:8] == PNG and (out / "curves.png").read_bytes()[:8] == PNG
    assert (out / "report.md").read_text().strip() in printed
    data = json.loads((out / "report.json").read_text())
    assert data["baseline"] == "bf16"
    assert {r["scheme"] for r in data["rows"]} >= {"nvidia", "quartet2"}
    assert len(data["no_baseline"]) == 3
    assert "--writeback" in printed and "skipped" in printed  # file runs cannot be written back


def test_script_runs_as_a_command(runs_root, tmp_path):
    proc = subprocess.run([sys.executable, "scripts/compare_runs.py", str(runs_root), "--plot",
                           str(tmp_path / "g.png")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Final validation loss and loss gap to bf16" in proc.stdout
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG


def test_empty_inputs_fail_clearly(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no runs found" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    with pytest.raises(analysis.CompareError, match="no runs found"):
        analysis.compare([])


def test_only_unpaired_runs_make_no_plot_but_a_table(tmp_path, capsys):
    local_run(tmp_path, "50m-quartet2-25tpp-s0", model="50m", scheme="quartet2", seed=0, tokens=25 * P50,
              params=P50, final=3.40, curve={300: 3.40})
    assert main([str(tmp_path), "--plot", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "Runs without a matching bf16 baseline" in out and "no loss-gap plot" in out
    assert not (tmp_path / "g.png").exists()


def test_unpaired_seeds_fall_back_to_means(tmp_path):
    local_run(tmp_path, "a", model="30m", scheme="bf16", seed=0, tokens=T25, params=P30, final=3.5, curve={1: 3.5})
    local_run(tmp_path, "b", model="30m", scheme="nvidia", seed=7, tokens=T25, params=P30, final=3.6, curve={1: 3.6})
    runs, notes = analysis.collect_paths([tmp_path])
    report = analysis.compare(runs, notes=notes)
    row = _row(report.rows, "nvidia")
    assert not row.paired and row.gap == pytest.approx(0.1)
    assert "(unpaired)" in analysis.markdown(report)


def test_another_baseline_is_named_in_the_report(runs_root):
    runs, notes = analysis.collect_paths([runs_root])
    report = analysis.compare(runs, baseline="nvidia", notes=notes)
    q2 = _row(report.rows, "quartet2")
    assert q2.gap == pytest.approx(3.545 - 3.56) and q2.n == 1
    text = analysis.markdown(report)
    assert "paired with the nvidia run of the same seed" in text and "above nvidia's" in text
    assert "BF16" not in text
    assert analysis.report_json(report)["baseline"] == "nvidia"


def test_a_resumed_run_dir_is_one_run_and_duplicates_count_once(tmp_path, runs_root):
    """A resumed run has two W&B folders of one id and one metrics.jsonl: one run; the same run
    found again (a copy) is counted once."""
    d = local_run(tmp_path / "resumed", "30m-nvidia-25tpp-s0", model="30m", scheme="nvidia", seed=0, tokens=T25,
                  params=P30, final=3.56, curve={100: 4.1, 200: 3.65, 300: 3.56}, config="json")
    wandb_folder(d, "resume01", "20261202_010101")
    wandb_folder(d, "resume01", "20261202_020202")
    runs, notes = analysis.collect_paths([tmp_path / "resumed"])
    assert len(runs) == 1 and runs[0].run_id == "resume01" and notes == []
    assert runs[0].val_curve == {100: 4.1, 200: 3.65, 300: 3.56} and runs[0].final_val_loss == 3.56
    shutil.copytree(runs_root / "30m-bf16-25tpp-s0", tmp_path / "30m-bf16-25tpp-s0")
    runs, notes = analysis.collect_paths([tmp_path / "resumed", runs_root / "30m-nvidia-25tpp-s0",
                                          tmp_path / "30m-bf16-25tpp-s0"])
    report = analysis.compare(runs, notes=notes)
    assert _row(report.rows, "nvidia").n == 1
    assert any("duplicate" in n for n in report.notes)


class _FakeSummary(dict):
    def __init__(self, data):
        super().__init__(data)
        self.updates = 0

    def update(self, *args, **kw):  # wandb's Summary.update() with no arguments pushes to the server
        if args or kw:
            super().update(*args, **kw)
        else:
            self.updates += 1


class _FakeRun:
    def __init__(self, rid, name, scheme, final, curve):
        self.id, self.name = rid, name
        self.config = {"seed": 0, "model": {"name": "30m"}, "quant": {"name": scheme}, "_wandb": {}}
        self.summary = _FakeSummary({"final_val_loss": final, "tokens": T25, "non_embedding_params": P30,
                                     "_step": max(curve)})
        self._curve = curve

    def scan_history(self, keys=None):
        return [{"_step": s, "val/loss": v} for s, v in self._curve.items()]


class _FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def runs(self, path):
        assert path == "team/proj"
        return self._runs


class _FakeWriter:
    """What ``wandb.init(id=..., resume="must")`` returns, recording what is written."""

    def __init__(self):
        self.metrics, self.rows, self.summary, self.finished = {}, [], {}, False

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, row):
        self.rows.append(row)

    def finish(self):
        self.finished = True


def test_wandb_api_source_and_writeback():
    base = _FakeRun("r1", "30m-bf16-25tpp-s0", "bf16", 3.5, {100: 4.0, 200: 3.7, 300: 3.5})
    q2 = _FakeRun("r2", "30m-quartet2-25tpp-s0", "quartet2", 3.55, {100: 4.1, 200: 3.8, 250: 3.6, 300: 3.55})
    runs = analysis.collect_wandb_project("team/proj", api=_FakeApi([base, q2]))
    report = analysis.compare(runs)
    row = _row(report.rows, "quartet2")
    assert row.gap == pytest.approx(0.05) and row.curve == pytest.approx({100: 0.1, 200: 0.1, 300: 0.05})
    messages, writers = [], {}

    def resume(run):
        assert run.path == f"team/proj/{run.run_id}"
        return writers.setdefault(run.run_id, _FakeWriter())

    assert analysis.writeback([r for r in report.rows if r.gap is not None], log=messages.append,
                              resume=resume) == 1
    w = writers["r2"]
    assert set(writers) == {"r2"} and w.finished
    assert w.metrics == {"gap_step": None, "val/loss_gap*": "gap_step"}  # the curve's own axis
    assert [r["gap_step"] for r in w.rows] == [100, 200, 300]  # 250: the baseline has no value there
    assert [r["val/loss_gap"] for r in w.rows] == pytest.approx([0.1, 0.1, 0.05])
    assert [r["val/loss_gap_rel"] for r in w.rows] == pytest.approx([0.1 / 4.0, 0.1 / 3.7, 0.05 / 3.5])
    assert w.summary == pytest.approx({"loss_gap": 0.05, "loss_gap_baseline": 3.5})
    assert "gap curve and loss_gap written to 1" in messages[-1]


def test_both_gaps_of_runs_validated_in_bf16_too(tmp_path, capsys):
    """Runs with final_val_loss_bf16 (train.eval_bf16) get the gap of both losses to the same
    bf16 losses, paired by seed; a switched run is labelled by its recipe and pairs with bf16."""
    for seed, base, own, own_bf16 in ((0, 3.50, 3.56, 3.52), (1, 3.52, 3.57, 3.55)):
        local_run(tmp_path, f"30m-bf16-25tpp-s{seed}", model="30m", scheme="bf16", seed=seed, tokens=T25,
                  params=P30, final=base, curve={300: base}, config="json")
        for extra in ({}, {"schedule": {"at": 0.8, "precision": "bf16_forward"}}):
            name = f"30m-nvidia{'+fwdbf16@80%' if extra else ''}-25tpp-s{seed}"
            d = local_run(tmp_path, name, model="30m", scheme="nvidia", seed=seed, tokens=T25, params=P30,
                          final=own - 0.02 * bool(extra), curve={300: own}, config="json", quant_extra=extra)
            summary = json.loads((d / "summary.json").read_text())
            (d / "summary.json").write_text(json.dumps(summary | {"final_val_loss_bf16": own_bf16}))
    runs, notes = analysis.collect_paths([tmp_path])
    report = analysis.compare(runs, notes=notes)
    plain, switched = _row(report.rows, "nvidia"), _row(report.rows, "nvidia[fwdbf16@80%]")
    assert plain.gap == pytest.approx(0.055) and plain.gap_bf16 == pytest.approx(0.025)
    assert switched.gap == pytest.approx(0.035) and switched.gap_bf16 == pytest.approx(0.025)
    assert main([str(tmp_path), "--no-plot", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| gap | gap, BF16 val | n |" in out
    assert "| nvidia[fwdbf16@80%] | 3.5450 | 3.5100 | +0.0350 ± 0.0071 | +0.0250 | 2 |" in out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["scheme"]: r["loss_gap_bf16"] for r in rows} == pytest.approx(
        {"bf16": None, "nvidia": 0.025, "nvidia[fwdbf16@80%]": 0.025})
