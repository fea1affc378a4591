"""README's quick-start numbers come from the code: the default run (``python train.py``: the tiny
model, quartet2, the bundled corpus) is trained for its first 100 steps and its validation losses
at steps 0 and 100 are checked against the sentence in README.md, so the text cannot go stale
silently. 100 steps of the default run: its time grows with the load on the cores."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from training import errors, trainer
from training.preemption import STOP_FILE
from training.tracking import Tracker

REPO = Path(__file__).resolve().parents[1]
SENTENCE = re.compile(r"validation loss falls from ([\d.]+) at step 0 to ([\d.]+), ([\d.]+) and ([\d.]+) at\s+steps"
                      r"\s+100, 200 and 300")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def readme_losses() -> tuple[str, ...]:
    found = SENTENCE.search(" ".join((REPO / "README.md").read_text().split()))
    assert found, "README.md lost its quick-start sentence on the validation losses"
    return found.groups()


def test_readme_quick_start_losses(compose_train, data_cache, tmp_path, monkeypatch):
    at_0, at_100, _, _ = readme_losses()
    run_dir = tmp_path / "run"
    # The default config as `python train.py` composes it; W&B off (it changes no number).
    cfg = compose_train([f"data.cache_dir={data_cache}", f"run_dir={run_dir}", "wandb.enabled=false",
                         "device=cpu"])
    assert (cfg.model.name, cfg.quant.name, cfg.train.steps) == ("tiny", "quartet2", 300)
    real_log = Tracker.log

    def log_then_stop_at_100(self, step, *args, **kwargs):
        real_log(self, step, *args, **kwargs)
        if step == 100:
            (run_dir / STOP_FILE).touch()  # the remaining 200 steps are not needed here

    monkeypatch.setattr(Tracker, "log", log_then_stop_at_100)
    with pytest.raises(errors.Preempted):
        trainer.run(cfg)
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    # README rounds: one decimal at step 0, two at step 100 (half a unit of the last digit, and
    # as much again for float-summation differences between CPUs).
    assert rows[0]["val/loss"] == pytest.approx(float(at_0), abs=0.1), rows[0]
    assert rows[100]["val/loss"] == pytest.approx(float(at_100), abs=0.01), rows[100]
