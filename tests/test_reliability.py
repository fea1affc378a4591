"""The trainer under faults (docs/reliability.md): non-finite values, corrupt checkpoints, fresh
starts over an earlier run, stop requests at any moment, a full disk, a hung rank, bad settings.

Tiny CPU runs through ``trainer.run(cfg)`` (the ``tiny`` fixture of tests/test_train.py: 8×128
tokens per step, FP32), a few steps each.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST
from test_train import checkpoint_state, checkpoint_steps, read_metrics

from training import checkpoint as ckpt
from training import errors, trainer
from training.checkpoint import Checkpointer, file_checksum, read_extra, verify
from training.distributed import init_distributed
from training.preemption import REQUEUE_FILE, STOP_FILE, PreemptionWatcher
from training.step import TrainStep
from training.tracking import Tracker

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def all_finite(path: Path, scratch: Path) -> bool:
    state = checkpoint_state(path, scratch)

    def walk(x) -> bool:
        if isinstance(x, torch.Tensor):
            return not x.is_floating_point() or bool(x.isfinite().all())
        if isinstance(x, dict):
            return all(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return all(walk(v) for v in x)
        return True

    return walk(state)


def poison_gradient_at(monkeypatch, step: int) -> None:
    """From optimizer step ``step`` on, one weight's gradient is NaN while the loss stays finite
    (a hook on the first block's query-key-value weight)."""
    real = trainer.build_adamw
    calls = {"n": 0}

    def build(model, *args, **kwargs):
        weight = next(p for n, p in model.named_parameters() if "qkv" in n)

        def hook(grad):
            calls["n"] += 1
            return grad * float("nan") if calls["n"] >= step else grad

        weight.register_hook(hook)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "build_adamw", build)


def run_killed_after_saving(cfg, step: int, monkeypatch) -> None:
    """Run ``cfg`` and break it off right after the checkpoint of ``step`` is written (a
    KeyboardInterrupt raised from the save stands in for SIGKILL)."""
    real_save = Checkpointer.save

    def save_then_kill(self, at, *args, **kwargs):
        out = real_save(self, at, *args, **kwargs)
        if at == step:
            raise KeyboardInterrupt
        return out

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", save_then_kill)
        with pytest.raises(KeyboardInterrupt):
            trainer.run(cfg)


# ----------------------------------------------------------------------------- non-finite values


def test_nan_gradient_with_finite_loss_stops_before_saving(tiny, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        poison_gradient_at(m, 5)
        cfg = tiny("train.steps=8", "train.ckpt_every=2", "train.eval_every=1000")
        with pytest.raises(errors.TrainingError) as info:
            trainer.run(cfg)
    msg = str(info.value)
    good = Path(cfg.run_dir) / "checkpoints" / "step_00000004"
    assert "gradient norm is nan" in msg and re.search(r"\bstep 5\b", msg), msg
    assert str(good) in msg
    assert checkpoint_steps(cfg.run_dir) == [2, 4]
    assert all(all_finite(p, tmp_path / f"{p.name}.pt") for _, p in Checkpointer(good.parent).all())
    assert max(read_metrics(cfg.run_dir)) == 4  # step 5 is neither logged nor saved

    # The fix the message gives works: resume from step 4 with half the learning rate.
    fix = re.search(r"(optim\.lr=\S+) '(resume_with_changes=\[optim\.lr\])'", msg)
    assert fix, msg
    summary = trainer.run(tiny("train.steps=8", "train.ckpt_every=2", "train.eval_every=1000", *fix.groups()))
    log = (Path(cfg.run_dir) / "train.log").read_text()
    assert "resuming at step 4" in log and "changed setting (resume_with_changes): optim.lr" in log
    # Every save is logged with its size and time.
    assert re.search(r"step 4: checkpoint of 18\.\d MiB saved in \d+\.\d s: \S+step_00000004\n", log), log
    assert summary["steps"] == 8 and sorted(read_metrics(cfg.run_dir)) == list(range(0, 9))


def test_nan_between_reads_is_found_at_its_step(tiny, monkeypatch):
    """The health of steps 5–8 is read once, at the checkpoint of step 8: the run stops there,
    names step 5, and logs and saves nothing from step 5 on."""
    with monkeypatch.context() as m:
        poison_gradient_at(m, 5)
        cfg = tiny("train.steps=8", "train.ckpt_every=4", "train.log_every=100", "train.eval_every=1000")
        with pytest.raises(errors.TrainingError, match=r"gradient norm is nan .*at step 5\b"):
            trainer.run(cfg)
    assert checkpoint_steps(cfg.run_dir) == [4]
    assert max(read_metrics(cfg.run_dir)) == 4


def test_nonfinite_parameter_after_the_update_stops_the_run(tiny, monkeypatch):
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000")
    with pytest.raises(errors.TrainingError, match=r"a parameter is non-finite after the optimizer step "
                                                  r"\(loss and gradient norm are finite\) at step 3"):
        trainer.run(cfg)
    assert checkpoint_steps(cfg.run_dir) == [2]


def test_checkpointer_refuses_to_save_nonfinite_state(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    cp = Checkpointer(tmp_path / "ck")
    refused = r"refusing to save step 3: 1 tensor\(s\) hold NaN or inf \(model\.weight\)"
    with pytest.raises(ckpt.CheckpointError, match=refused):
        cp.save(3, model, opt, {"step": 3})
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


# ----------------------------------------------------------------------------- corrupt checkpoints


def test_corrupt_shard_falls_back_to_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    common = ("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000")
    reference = trainer.run(tiny(*common, run="reference"))

    cfg = tiny(*common)
    run_killed_after_saving(cfg, 4, monkeypatch)
    newest = Path(cfg.run_dir) / "checkpoints" / "step_00000004"
    shard = newest / "__0_0.distcp"
    assert shard.stat().st_size > 5 * 2**20 + 4096
    with open(shard, "r+b") as f:  # same size, other bytes
        f.seek(5 * 2**20)
        f.write(os.urandom(4096))
    assert "does not match its checksum" in verify(newest)

    summary = trainer.run(tiny(*common))
    log = (Path(cfg.run_dir) / "train.log").read_text()
    assert f"warning: skipped checkpoint {newest}: __0_0.distcp does not match its checksum" in log
    assert "resuming at step 2" in log
    assert summary == {**reference}  # the replayed steps 3-4 and the rest are those of an unbroken run
    assert sorted(read_metrics(cfg.run_dir)) == list(range(0, 7))
    replaced = [json.loads(r)["step"] for r in (Path(cfg.run_dir) / "metrics.replaced.jsonl").read_text().splitlines()]
    assert replaced == [3, 4]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch EVIL_RAN",))


def test_extra_state_is_never_unpickled_as_code(tiny, tmp_path, monkeypatch):
    cfg = tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000")
    run_killed_after_saving(cfg, 4, monkeypatch)
    newest = Path(cfg.run_dir) / "checkpoints" / "step_00000004"
    # A checkpoint from someone else: extra.pt runs code when unpickled, and its manifest agrees.
    (newest / "extra.pt").write_bytes(pickle.dumps({"step": 4, "x": _Evil()}))
    manifest = json.loads((newest / "COMPLETE").read_text())
    manifest["files"]["extra.pt"] = {"size": (newest / "extra.pt").stat().st_size,
                                     "xxh3_128": file_checksum(newest / "extra.pt")}
    (newest / "COMPLETE").write_text(json.dumps(manifest))
    assert verify(newest) is None

    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        read_extra(newest)
    trainer.run(tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000"))
    assert not (tmp_path / "EVIL_RAN").exists()
    log = (Path(cfg.run_dir) / "train.log").read_text()
    assert f"warning: skipped checkpoint {newest}: extra.pt does not load (UnpicklingError" in log
    assert "resuming at step 2" in log


def test_garbage_extra_of_the_same_size_is_skipped(tiny, monkeypatch):
    cfg = tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000")
    run_killed_after_saving(cfg, 4, monkeypatch)
    extra = Path(cfg.run_dir) / "checkpoints" / "step_00000004" / "extra.pt"
    extra.write_bytes(os.urandom(extra.stat().st_size))
    trainer.run(tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000"))
    log = (Path(cfg.run_dir) / "train.log").read_text()
    assert "extra.pt does not match its checksum" in log and "resuming at step 2" in log


def test_no_checkpoint_verifies_moves_the_run_aside(tiny):
    cfg = tiny("train.steps=2", "train.ckpt_every=2", "train.eval_every=1000")
    trainer.run(cfg)
    shard = Path(cfg.run_dir) / "checkpoints" / "step_00000002" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.write(b"\0" * 64)
    trainer.run(cfg)
    log = (Path(cfg.run_dir) / "train.log").read_text()
    asides = list(Path(cfg.run_dir).parent.glob("run.replaced-*"))
    assert len(asides) == 1 and (asides[0] / "checkpoints" / "step_00000002").is_dir()
    assert "warning: skipped checkpoint" in log and "does not match its checksum" in log
    assert (f"starting from step 0 (no checkpoint of it verifies): the earlier run in {cfg.run_dir} "
            f"was moved to {asides[0]}") in log
    assert sorted(read_metrics(cfg.run_dir)) == [0, 1, 2]


# ----------------------------------------------------------------------------- fresh starts


def test_resume_false_never_mixes_two_runs(tiny, monkeypatch):
    first = trainer.run(tiny("train.steps=3", "train.ckpt_every=1", "train.eval_every=1000"))
    second = ("seed=1", "train.steps=3", "train.ckpt_every=1", "train.eval_every=1000")
    run_killed_after_saving(tiny(*second, "resume=false"), 2, monkeypatch)
    cfg = tiny(*second)
    summary = trainer.run(cfg)  # resumes the seed-1 run, not refused as "another seed"
    run_dir = Path(cfg.run_dir)
    assert "resuming at step 2" in (run_dir / "train.log").read_text()
    assert summary["steps"] == 3 and summary != first
    assert sorted(read_metrics(run_dir)) == [0, 1, 2, 3]
    (aside,) = run_dir.parent.glob("run.replaced-*")
    assert json.loads((aside / "summary.json").read_text()) == first
    assert checkpoint_steps(aside) == [2, 3]


def test_finished_run_started_again_writes_nothing(tiny, capsys):
    cfg = tiny("wandb.enabled=true", "wandb.mode=offline", "train.steps=2", "train.eval_every=1000")
    summary = trainer.run(cfg)
    import wandb

    wandb.teardown()  # W&B's service finishes its own debug log after the run ends; stop it first
    run_dir = Path(cfg.run_dir)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert trainer.run(cfg) == summary
    out = capsys.readouterr().out
    assert f"run {run_dir} is already finished (2 of 2 steps" in out and "summary.json" in out
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*") if p.is_file()}
    assert after == before
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


# ----------------------------------------------------------------------------- stop requests


def test_stop_request_before_the_run_starts_is_kept(tiny):
    cfg = tiny("train.steps=4", "train.ckpt_every=2")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / STOP_FILE).touch()  # the sbatch trap fired before the trainer got going
    with pytest.raises(errors.Preempted):
        trainer.run(cfg)
    assert (run_dir / REQUEUE_FILE).is_file() and not (run_dir / STOP_FILE).exists()
    assert checkpoint_steps(run_dir) == []  # nothing trained: the requeued job starts at step 0
    assert trainer.run(cfg)["steps"] == 4


def test_sigterm_during_start_up_exits_for_requeue(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *FAST, f"data.cache_dir={data_cache}", f"run_dir={run_dir}", "train.steps=50"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(2)  # while torch and the model are still being imported and built
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert (run_dir / REQUEUE_FILE).is_file(), out + err
    assert "stop requested (SIGTERM)" in (run_dir / "train.log").read_text()


def test_resaving_a_step_never_loses_it(tiny, monkeypatch):
    common = ("train.steps=6", "train.ckpt_every=2", "train.eval_every=1000")
    cfg = tiny(*common)
    run_dir = Path(cfg.run_dir)
    run_killed_after_saving(cfg, 4, monkeypatch)
    # Resumed at step 4 with a stop request pending: the boundary save of step 4 is a re-save.
    # A kill while it replaces the directory would lose step 4; it must not be written at all.
    (run_dir / STOP_FILE).touch()
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "step_00000004":
            raise KeyboardInterrupt  # killed between removing the old step 4 and renaming the new one
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "replace", replace)
        with pytest.raises(errors.Preempted):
            trainer.run(cfg)
    assert checkpoint_steps(run_dir) == [2, 4] and verify(run_dir / "checkpoints" / "step_00000004") is None
    assert "step 4: already checkpointed" in (run_dir / "train.log").read_text()


def test_ctrl_c_checkpoints_and_stops(tiny, monkeypatch):
    cfg = tiny("train.steps=6", "train.ckpt_every=100", "train.eval_every=1000")
    callers_handler = signal.getsignal(signal.SIGINT)
    real_step = TrainStep.__call__

    def step_then_ctrl_c(self, step, *args, **kwargs):
        health = real_step(self, step, *args, **kwargs)
        if step + 1 == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return health

    with monkeypatch.context() as m:
        m.setattr(TrainStep, "__call__", step_then_ctrl_c)
        with pytest.raises(errors.Interrupted, match=r"stopped by Ctrl-C before step 4: checkpointed step 3 to .*"
                                                    r"Resume with the same command"):
            trainer.run(cfg, handle_ctrl_c=True)
    assert checkpoint_steps(cfg.run_dir) == [3]
    assert not (Path(cfg.run_dir) / REQUEUE_FILE).exists()
    assert signal.getsignal(signal.SIGINT) is callers_handler  # Ctrl-C is the caller's again
    assert trainer.run(cfg)["steps"] == 6
    assert "resuming at step 3" in (Path(cfg.run_dir) / "train.log").read_text()


def test_second_ctrl_c_stops_at_once(tiny, monkeypatch):
    cfg = tiny("train.steps=6", "train.ckpt_every=100", "train.eval_every=1000")
    real_log = Tracker.log

    def log_then_ctrl_c_twice(self, step, *args, **kwargs):
        real_log(self, step, *args, **kwargs)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as m:
        m.setattr(Tracker, "log", log_then_ctrl_c_twice)
        with pytest.raises(KeyboardInterrupt):
            trainer.run(cfg, handle_ctrl_c=True)
    assert checkpoint_steps(cfg.run_dir) == []
    assert max(read_metrics(cfg.run_dir)) == 3


def test_watchdog_exits_for_requeue_when_no_step_boundary_comes(tmp_path):
    watcher = PreemptionWatcher(tmp_path, signals=())
    fired: list[str] = []
    watcher.start_watchdog(0.3, on_expire=fired.append, poll_s=0.05)
    time.sleep(0.3)
    assert fired == []  # no request, no action
    (tmp_path / STOP_FILE).touch()
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    watcher.close()
    assert len(fired) == 1 and "the PREEMPT file" in fired[0] and "waited 0 s" in fired[0]

    acked = PreemptionWatcher(tmp_path, signals=())
    late: list[str] = []
    acked.start_watchdog(0.3, on_expire=late.append, poll_s=0.05)
    acked.acknowledge()  # the loop took the request up: the save may take as long as it takes
    time.sleep(0.6)
    acked.close()
    assert late == []


def _hang_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=3)
    if rank == 1:
        time.sleep(60)  # hung
        return
    t0 = time.monotonic()
    try:
        torch.distributed.barrier()
        result = "no timeout"
    except Exception as err:  # gloo's timeout
        result = f"{type(err).__name__} after {time.monotonic() - t0:.1f} s"
    Path(out).write_text(result)
    os._exit(0)


def test_process_group_timeout_is_the_configured_one(tmp_path):
    from training.distributed import _free_port

    ctx = torch.multiprocessing.get_context("spawn")
    out = tmp_path / "rank0.txt"
    port = _free_port()
    procs = [ctx.Process(target=_hang_rank, args=(r, port, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(120)
    procs[1].kill()
    result = out.read_text()
    seconds = float(re.search(r"after ([\d.]+) s", result).group(1))
    assert 2.5 <= seconds < 30, result


# ----------------------------------------------------------------------------- a full disk


def test_full_disk_is_named_and_leaves_no_partial_checkpoint(compose_train, data_cache, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 30 MB tmpfs here (needs root)")
    try:
        cfg = compose_train([*FAST, f"data.cache_dir={data_cache}", f"run_dir={mount / 'run'}",
                             "train.steps=6", "train.ckpt_every=2", "train.eval_every=1000"])
        with pytest.raises(errors.TrainingError) as info:
            trainer.run(cfg)
        msg = str(info.value)
        assert re.search(r"no space left on the disk of .* while saving step 4: \d+ MiB free, the checkpoint "
                         r"needs about 18 MiB", msg), msg
        assert "Fix: free space" in msg and "rerun the same command" in msg
        ckdir = mount / "run" / "checkpoints"
        assert sorted(p.name for p in ckdir.iterdir()) == ["step_00000002"]  # no partial .tmp
        assert verify(ckdir / "step_00000002") is None
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("override,message", [
    ("train.keep_checkpoints=-1",
     r"train\.keep_checkpoints=-1 would delete every checkpoint\. Fix: .*null to keep all"),
    ("train.keep_checkpoints=0", r"train\.keep_checkpoints=0 would delete every checkpoint"),
    ("train.micro_batch_size=0", r"train\.micro_batch_size=0 must be a whole number ≥ 1"),
    ("train.tokens_per_param=-1", r"train\.tokens_per_param=-1 must be a positive number"),
    ("train.steps=-5", r"train\.steps=-5 must be a positive number of optimizer steps"),
    ("train.eval_batches=100000", r"train\.eval_batches=100000 × train\.eval_batch_size=8: asked for 100000 "
                                  r"validation batches"),
], ids=["keep_-1", "keep_0", "micro_0", "tpp_-1", "steps_-5", "val_too_small"])
def test_bad_settings_fail_before_training(tiny, override, message):
    cfg = tiny(override)
    with pytest.raises((ValueError, errors.TrainingError), match=message):
        trainer.run(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()


def test_a_checkpoint_older_than_a_config_key_resumes_at_its_default(compose_train):
    """A fingerprint saved before quant.recipe, bf16_tail and schedule existed matches today's
    defaults (training.checkpoint.ADDED_KEYS), and still refuses a run that sets one of them."""
    from omegaconf import OmegaConf

    from training.checkpoint import ADDED_KEYS, config_fingerprint, fingerprint_changes

    cfg = compose_train(["quant=quartet2"])
    now = config_fingerprint(OmegaConf.to_container(cfg, resolve=True))
    assert set(ADDED_KEYS) <= set(now)
    old = {k: v for k, v in now.items() if k not in ADDED_KEYS}
    assert fingerprint_changes(old, now) == {}
    tail = config_fingerprint(OmegaConf.to_container(compose_train(["quant=quartet2", "quant.bf16_tail=2"]),
                                                     resolve=True))
    assert fingerprint_changes(old, tail) == {"quant.bf16_tail": (None, 2)}
