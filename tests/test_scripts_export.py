"""Tests of scripts/export_checkpoint.py's argument: a checkpoint, a run directory (its newest
complete checkpoint) or a path that does not exist, each with its own message. The checkpoints are
real DCP saves of a 2-layer model by training.checkpoint.Checkpointer (about a second in all)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.export_checkpoint import export, main, resolve_checkpoint
from training.checkpoint import Checkpointer

# Checkpointer saves in one process here, which DCP warns about; that is the intended mode.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory with complete checkpoints at steps 1 and 2 of a small model, each holding
    that step's weights, and a step 3 checkpoint whose COMPLETE manifest is missing (a save that
    did not finish)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = Checkpointer(tmp_path / "run" / "checkpoints", keep=None)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        saved = checkpoints.save(step, model, optimizer, {"step": step, "config": {"model": {"name": "t"}}})
    (saved.path / "COMPLETE").unlink()
    return tmp_path / "run"


def first_weight(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=False)["model"]["0.weight"]


def test_a_run_directory_exports_its_newest_complete_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    ckpts = run_dir / "checkpoints"
    assert resolve_checkpoint(run_dir) == ckpts / "step_00000002"
    out = export(run_dir, tmp_path / "run.pt")
    step1 = export(ckpts / "step_00000001", tmp_path / "step1.pt")
    assert torch.load(out, weights_only=False)["step"] == 2
    torch.testing.assert_close(first_weight(out), first_weight(step1) + 1.0)  # step 2 = step 1 + 1


def test_a_missing_path_says_it_does_not_exist(run_dir: Path) -> None:
    missing = run_dir / "checkpoints" / "step_00000007"
    with pytest.raises(FileNotFoundError, match=r"step_00000007 does not exist\. Fix: pass runs/<run>") as err:
        resolve_checkpoint(missing)
    assert "newest complete checkpoint in" in str(err.value) and str(err.value).endswith("step_00000002.")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        resolve_checkpoint(run_dir.parent / "nowhere")


def test_an_incomplete_checkpoint_points_to_the_newest_complete_one(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="step_00000003 is not a complete checkpoint") as err:
        resolve_checkpoint(run_dir / "checkpoints" / "step_00000003")
    assert str(err.value).endswith("step_00000002.")


def test_a_run_without_complete_checkpoints_and_other_directories(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="has no complete checkpoint"):
        resolve_checkpoint(tmp_path / "run")
    with pytest.raises(ValueError, match="neither a checkpoint .* nor a run directory"):
        resolve_checkpoint(tmp_path)


def test_cli_prints_one_line_errors_and_the_checkpoint_it_chose(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "typo"), str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "typo does not exist" in err and err.count("\n") == 1
    assert not (tmp_path / "m.pt").exists()
    assert main([str(run_dir), str(tmp_path / "m.pt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"exporting {run_dir / 'checkpoints' / 'step_00000002'}, the newest complete checkpoint "
                   f"of {run_dir}", str(tmp_path / "m.pt")]
