"""FSDP2 on 2 CPU ranks (gloo) against one process; exact resume after a kill; DCP checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training import trainer
from training.checkpoint import Checkpointer, is_complete

REPO = Path(__file__).resolve().parents[1]
SCHEMES = ["bf16", "nvidia", "four_over_six", "tetrajet_v2", "quartet2"]


def _overrides(run_dir: Path, data_cache: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}", f"data.cache_dir={data_cache}", "device=cpu", "wandb.enabled=false",
        "train.seq_len=128", "train.batch_size=8", "train.micro_batch_size=2", "train.eval_batch_size=4",
        "train.eval_batches=2", "train.log_every=1", "train.eval_every=3", *extra,
    ]


def torchrun(tmp_path: Path, runs: list[dict], expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run ``runs`` (see tests/dist_driver.py) on 2 gloo ranks."""
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "dist_driver.py"), str(spec)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def val_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}


def test_fsdp2_matches_one_process_on_the_same_global_batch(tmp_path, compose_train, data_cache):
    extra = ("quant=bf16", "precision=fp32", "train.steps=6")
    single = tmp_path / "single"
    torch.set_num_threads(1)
    trainer.run(compose_train(_overrides(single, data_cache, *extra)))
    torchrun(tmp_path, [{"overrides": _overrides(tmp_path / "fsdp", data_cache, *extra)},
                        {"overrides": _overrides(tmp_path / "hsdp", data_cache, *extra, "parallel.replicate=2")}])
    a, b = losses(single), losses(tmp_path / "fsdp")
    hsdp = losses(tmp_path / "hsdp")  # a (2 replicas × 1 shard) mesh: replicate across, shard within
    assert max(abs(a[s] - hsdp[s]) for s in a) < 1e-5
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
    va, vb = val_losses(single), val_losses(tmp_path / "fsdp")
    assert va.keys() == vb.keys() and max(abs(va[s] - vb[s]) for s in va) < 1e-5
    assert a[6] < a[1]  # it trains


def test_fsdp2_runs_every_scheme_in_bf16(tmp_path, data_cache):
    runs = [{"overrides": _overrides(tmp_path / s, data_cache, f"quant={s}", "precision=bf16", "train.steps=2")}
            for s in SCHEMES]
    torchrun(tmp_path, runs)
    for s in SCHEMES:
        summary = json.loads((tmp_path / s / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["scheme"] == s
        assert all(map(lambda v: v == v and v < 20, losses(tmp_path / s).values()))


@pytest.mark.parametrize("scheme", ["bf16", "quartet2"])
def test_kill_after_checkpoint_then_resume_is_exact(tmp_path, data_cache, scheme):
    extra = (f"quant={scheme}", "precision=bf16", "train.steps=6", "train.ckpt_every=3")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    torchrun(tmp_path, [{"overrides": _overrides(whole, data_cache, *extra)}])
    crash = torchrun(tmp_path, [{"overrides": _overrides(killed, data_cache, *extra), "exit_after_checkpoint": 3}],
                     expect_ok=False)
    assert crash.returncode != 0
    assert sorted(losses(killed)) == [1, 2, 3]
    torchrun(tmp_path, [{"overrides": _overrides(killed, data_cache, *extra)}])
    assert "resuming at step 3" in (killed / "train.log").read_text()
    a, b = losses(whole), losses(killed)
    assert [a[s] for s in range(4, 7)] == [b[s] for s in range(4, 7)]  # bit-identical, not approx
    assert json.loads((whole / "summary.json").read_text())["final_val_loss"] == \
        json.loads((killed / "summary.json").read_text())["final_val_loss"]


def test_truncated_or_unfinished_checkpoint_is_ignored(tmp_path, compose_train, data_cache):
    run_dir = tmp_path / "run"
    extra = ("quant=bf16", "precision=fp32", "train.steps=4", "train.ckpt_every=2", "train.keep_checkpoints=3")
    trainer.run(compose_train(_overrides(run_dir, data_cache, *extra)))
    ckpts = Checkpointer(run_dir / "checkpoints")
    assert [s for s, _ in ckpts.all()] == [2, 4]
    shard = next((run_dir / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated write
    (run_dir / "checkpoints" / ".step_00000006.tmp").mkdir()  # an unfinished save
    assert not is_complete(run_dir / "checkpoints" / "step_00000004")
    assert ckpts.latest() == run_dir / "checkpoints" / "step_00000002"
    trainer.run(compose_train(_overrides(run_dir, data_cache, *extra)))
    assert "resuming at step 2" in (run_dir / "train.log").read_text()


def test_resume_on_another_world_size_is_refused_unless_resharding(tmp_path, compose_train, data_cache):
    run_dir = tmp_path / "run"
    extra = ("quant=bf16", "precision=fp32", "train.steps=3", "train.ckpt_every=1")
    torchrun(tmp_path, [{"overrides": _overrides(run_dir, data_cache, *extra), "exit_after_checkpoint": 2}],
             expect_ok=False)
    with pytest.raises(ValueError, match=r"world_size: 2 in the checkpoint, 1 now.*Fix"):
        trainer.run(compose_train(_overrides(run_dir, data_cache, *extra)))
    # explicit reshard path: DCP loads the 2-rank shards into one process
    summary = trainer.run(compose_train(_overrides(run_dir, data_cache, *extra, "parallel.allow_reshard=true")))
    assert "resuming at step 2" in (run_dir / "train.log").read_text()
    assert summary["world_size"] == 1


def test_export_consolidates_a_sharded_checkpoint(tmp_path, data_cache):
    from model import build_model
    from scripts.export_checkpoint import export

    run_dir = tmp_path / "run"
    torchrun(tmp_path, [{"overrides": _overrides(run_dir, data_cache, "quant=quartet2", "train.steps=2")}])
    out = export(run_dir / "checkpoints" / "step_00000002", tmp_path / "model.pt")
    blob = torch.load(out, weights_only=False)
    model = build_model(blob["config"]["model"])
    model.load_state_dict(blob["model"])
    assert blob["step"] == 2 and blob["config"]["quant"]["name"] == "quartet2"


def test_async_checkpoints_resume_exactly(tmp_path, compose_train, data_cache):
    """train.async_checkpoint=true: saves finish in the background, are completed before the next
    one, and a resumed run continues exactly."""
    extra = ("quant=quartet2", "precision=fp32", "train.steps=4", "train.ckpt_every=2",
             "train.async_checkpoint=true", "train.keep_checkpoints=3")
    whole = tmp_path / "whole"
    trainer.run(compose_train(_overrides(whole, data_cache, *extra)))
    assert [s for s, _ in Checkpointer(whole / "checkpoints").all()] == [2, 4]
    part = tmp_path / "part"
    trainer.run(compose_train(_overrides(part, data_cache, *extra)))
    shutil.rmtree(part / "checkpoints" / "step_00000004")  # as if killed after step 2's save
    lines = (part / "metrics.jsonl").read_text().splitlines()[:3]  # steps 0, 1, 2
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    trainer.run(compose_train(_overrides(part, data_cache, *extra)))
    assert "resuming at step 2" in (part / "train.log").read_text()
    assert losses(part) == losses(whole)


def _metrics(run_dir: Path) -> list[dict]:
    """The metrics rows without timings (the numbers a run's arithmetic decides)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "time/"))} for r in rows]


def _final_state(run_dir: Path, tmp_path: Path) -> dict:
    """Model and optimizer state of a run's last checkpoint, consolidated."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
    out = tmp_path / f"{run_dir.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def _flat_tensors(state, prefix=""):
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _flat_tensors(v, f"{prefix}{k}.")
    elif isinstance(state, torch.Tensor):
        yield prefix, state


QUANTIZED = [s for s in SCHEMES if s != "bf16"]
GATHER_STEPS, COUNTED_STEPS, ACCUM = 20, 2, 2  # 8 sequences per step, 2 per micro-batch, 2 ranks


@pytest.fixture(scope="module")
def gather_runs(tmp_path_factory, data_cache) -> Path:
    """Every quantized scheme under weight_gather=bf16 and =nvfp4 on 2 gloo ranks (one torchrun):
    20 steps in BF16, validated with their own and with BF16 linears, the collectives of the
    first 2 counted; nvidia with its forward switched to BF16 from step 10 in both settings; and
    1 step of nvidia under delayed_amax, whose weights cannot travel as Ŵ."""
    tmp = tmp_path_factory.mktemp("gather")
    extra = ("precision=bf16", f"train.steps={GATHER_STEPS}", "train.eval_every=10", "train.ckpt_every=20")
    runs = [{"overrides": _overrides(tmp / f"{s}-{g}", data_cache, f"quant={s}", f"parallel.weight_gather={g}",
                                     *extra), "count_collectives": COUNTED_STEPS}
            for s in QUANTIZED for g in ("bf16", "nvfp4")]
    runs += [{"overrides": _overrides(tmp / f"switched-{g}", data_cache, "quant=nvidia", f"parallel.weight_gather={g}",
                                      "quant.schedule.at=10", *extra)} for g in ("bf16", "nvfp4")]
    runs.append({"overrides": _overrides(tmp / "delayed", data_cache, "quant=nvidia", "quant.delayed_amax=true",
                                         "precision=bf16", "train.steps=1")})
    torchrun(tmp, runs)
    return tmp


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_nvfp4_weight_gather_is_bit_identical_to_bf16_gather(gather_runs, tmp_path, scheme):
    """parallel.weight_gather=nvfp4 (quant/fsdp_gather.py) against bf16, on 2 ranks: 20 steps of
    2 micro-batches per rank: the same losses, gradient norms and validation losses to the bit,
    and the same final weights and optimizer state."""
    a, b = gather_runs / f"{scheme}-bf16", gather_runs / f"{scheme}-nvfp4"
    rows = _metrics(a)
    assert rows == _metrics(b)
    assert sum("train/grad_norm" in r for r in rows) == GATHER_STEPS and sum("val/loss" in r for r in rows) == 3
    assert sum("val/loss_bf16" in r for r in rows) == 3  # W itself gathered for the BF16 validation
    sa, sb = dict(_flat_tensors(_final_state(a, tmp_path))), dict(_flat_tensors(_final_state(b, tmp_path)))
    assert sa.keys() == sb.keys() and any("qkv" in k for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "all-gathered in BF16" not in (b / "train.log").read_text()


@pytest.mark.parametrize("scheme,bits", [("quartet2", 4.5), ("tetrajet_v2", 4.5), ("nvidia", 4 + 8 / 256),
                                         ("four_over_six", 4 + 8 / 256)])
def test_nvfp4_weight_gather_moves_3_3x_fewer_bytes(gather_runs, scheme, bits):
    """The bytes each rank all-gathers per step (training/comm_bytes.py, counted as c10d runs
    them) are what quant.fsdp_gather.gathered_bytes predicts, and the quantized linears' weights
    move ≥ 3.3× fewer bytes in NVFP4 than in BF16 (16 bits a value against 4.5, or 4.03 with
    16×16 tiles)."""
    import yaml

    import quant
    from model import build_model
    from quant.fsdp_gather import gathered_bytes

    preset = yaml.safe_load((REPO / "configs" / "model" / "tiny.yaml").read_text())
    model = quant.quantize_model(build_model(preset, device="meta"), scheme)
    measured, linear = {}, {}
    for g in ("bf16", "nvfp4"):
        expected = gathered_bytes(model, 2, 2, g)
        for rank in (0, 1):
            counted = json.loads((gather_runs / f"{scheme}-{g}" / f"collectives-rank{rank}.json").read_text())
            measured[g] = counted["bytes"]["all_gather"] / COUNTED_STEPS
            assert measured[g] == 2 * ACCUM * sum(expected.values()), (g, rank)
        linear[g] = measured[g] - 2 * ACCUM * expected["other"]
    assert linear["bf16"] / linear["nvfp4"] >= 3.3
    assert linear["bf16"] / linear["nvfp4"] == pytest.approx(16 / bits)


def test_nvfp4_weight_gather_follows_a_switch_to_bf16_forward(gather_runs):
    """After quant.schedule switches the forwards to BF16 the layers read W itself (gathered
    explicitly, quant.gathered.GatheredNVFP4Weight.whole): the same bits as the BF16 gather."""
    rows = _metrics(gather_runs / "switched-bf16")
    assert rows == _metrics(gather_runs / "switched-nvfp4")
    assert rows != _metrics(gather_runs / "nvidia-bf16")  # the switch changed the training


def test_a_layer_that_cannot_gather_w_hat_is_named(gather_runs):
    log = (gather_runs / "delayed" / "train.log").read_text()
    assert "weight_gather=nvfp4: blocks.0.attn.qkv is all-gathered in BF16: delayed_amax" in log


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,compile", [("quartet2", "true"), ("nvidia", "false")])
def test_nvfp4_weight_gather_on_a_gpu_matches_bf16_gather(tmp_path, data_cache, scheme, compile):
    """train.py under torchrun on one GPU with FSDP2 (``parallel.fsdp=true``), the kernels, NCCL
    and (quartet2) compiled blocks: weight_gather=nvfp4 trains the same bits as bf16."""
    for g in ("bf16", "nvfp4"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py",
               f"run_dir={tmp_path / g}", f"data.cache_dir={data_cache}", "wandb.enabled=false", f"quant={scheme}",
               "train.steps=12", "train.batch_size=16", "train.micro_batch_size=8", "train.log_every=1",
               "train.eval_every=6", "parallel.fsdp=true", f"compile={compile}", f"parallel.weight_gather={g}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _metrics(tmp_path / "bf16")
    assert rows == _metrics(tmp_path / "nvfp4") and sum("train/loss" in r for r in rows) == 12
