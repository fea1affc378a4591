"""Slurm support: the Hydra submitit launchers (configs/hydra/launcher/) and the sbatch templates
(slurm/*.sbatch), the latter on a real, throwaway single-node Slurm cluster (tests/slurm_cluster.py).

The cluster tests skip, with the reason, when Slurm is not installed (.ci/run installs it from
Debian) or the tests do not run as root. Otherwise they submit the project's own templates,
unchanged, as a user would, with 2 CPU ranks of the tiny model:

- a reference job through slurm/single_node.sbatch (bare srun, 2 tasks) runs to the end;
- the same job again, signalled mid-run the way Slurm does before the time limit
  (``scancel --signal=USR1 --batch``, i.e. ``--signal=B:USR1``): the batch script makes the ranks
  checkpoint and requeues the job, which resumes and ends with exactly the reference's losses;
- ``scancel`` of such a job cancels it (no requeue);
- the same through slurm/multi_node.sbatch (one torchrun per node, here one node);
- a Hydra sweep of 2 jobs through hydra/launcher=slurm;
- slurm/prepare.sbatch: an array of 3 tasks prepares the bundled corpus split into 6 files, the
  last task runs the final step, and the dataset is byte-identical to one process's.

Slurm holds a requeued batch job for about two minutes (its BeginTime); the tests lift that hold
with ``scontrol update jobid=... StartTime=now`` once the job has been pending for 3 s (at once,
slurmd may still refuse the job's new credential as revoked).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, parse_fields, unavailable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEPS = 20
# The tiny model on CPU: 2 ranks × 4 sequences of 128 tokens per step, FP32, a short validation.
TRAIN = [
    "device=cpu", "quant=quartet2", "precision=fp32", "wandb.enabled=false", "train.seq_len=128",
    "train.batch_size=8", "train.micro_batch_size=4", "train.eval_batches=2", "train.eval_batch_size=8",
    f"train.steps={STEPS}", "train.log_every=4", "train.eval_every=1000", "train.ckpt_every=4",
]
# 2 tasks of 1 CPU, no GPU (the templates ask for 8 GPUs per node), logs next to the runs.
SINGLE = ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
MULTI = ["--nodes=1", "--cpus-per-task=2", "--gpus-per-node=0", "--time=10"]


# ----------------------------------------------------------------------------- helpers


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_losses(run_dir: Path) -> tuple[float, float]:
    """(summary.json's final_val_loss, the last train/loss of metrics.jsonl)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["final_val_loss"], read_metrics(run_dir)[-1]["train/loss"]


class Jobs:
    """Submission of the templates to the throwaway cluster, with this module's environment."""

    def __init__(self, cluster: SlurmCluster, root: Path, data_cache: Path) -> None:
        self.cluster, self.root = cluster, root
        self.runs = root / "runs"
        self.env = {
            "PYTHON": sys.executable,
            "RUN_ROOT": str(self.runs),
            "NFP4_DATA_CACHE": str(data_cache),
            "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "offline",
        }

    def submit(self, template: str, sbatch_args: list[str], overrides: list[str], **env: str) -> str:
        args = [f"--output={self.root}/%x-%j.out", *sbatch_args, f"slurm/{template}", *overrides]
        return self.cluster.sbatch(args, env={**self.env, **env}, cwd=REPO)

    def run_dir(self, job: str) -> Path:
        return self.runs / f"nvfp4-{job}"  # the templates' RUN_ROOT/<job name>-<job id>

    def log(self, job: str) -> str:
        path = self.root / f"nvfp4-{job}.out"
        return path.read_text(errors="replace") if path.exists() else "(no batch log)"

    def wait_done(self, job: str, timeout: float = 300, lift_requeue_hold: bool = False) -> dict:
        held_since: list[float] = []

        def lift(fields: dict) -> None:
            # Not at once: slurmd refuses to start a job whose credential (second resolution) is not
            # newer than the revocation of its previous incarnation ("Job credential revoked").
            if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                held_since[:] = held_since or [time.monotonic()]
                if time.monotonic() - held_since[0] >= 3:
                    self.cluster.cmd("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)

        fields = self.cluster.wait(job, timeout=timeout, on_poll=lift if lift_requeue_hold else None)
        assert fields["JobState"] == "COMPLETED", f"job {job}: {fields}\n{self.log(job)}"
        return fields

    def wait_checkpoint(self, job: str, timeout: float = 180) -> Path:
        """The first complete checkpoint of a running job (the job must still be running)."""
        ckpts = self.run_dir(job) / "checkpoints"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = sorted(ckpts.glob("step_*/COMPLETE")) if ckpts.is_dir() else []
            if done:
                return done[0].parent
            state = self.cluster.job(job).get("JobState")
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {job} is {state} before its first checkpoint\n{self.log(job)}"
            time.sleep(0.2)
        raise TimeoutError(f"job {job} wrote no checkpoint in {timeout} s\n{self.log(job)}")

    def preempt_and_finish(self, job: str) -> tuple[dict, int]:
        """Signal a running job like Slurm before its time limit, then wait for its requeued run;
        (its final scontrol fields, the step it resumed at)."""
        first = self.wait_checkpoint(job)
        assert self.cluster.job(job)["JobState"] == "RUNNING"
        self.cluster.cmd("scancel", "--signal=USR1", "--batch", job)  # the batch shell only
        fields = self.wait_done(job, lift_requeue_hold=True)
        log = self.log(job)
        assert fields["Restarts"] == "1", f"job {job} was not requeued once: {fields}\n{log}"
        assert "caught USR1" in log and "requeueing job" in log, log
        train_log = (self.run_dir(job) / "train.log").read_text()
        resumed = re.findall(r"resuming at step (\d+) from", train_log)
        assert len(resumed) == 1, f"expected one resume in train.log:\n{train_log}"
        step = int(resumed[0])
        assert int(first.name.split("_")[1]) <= step < STEPS, (first, step)
        assert f"stop requested (the PREEMPT file): checkpointed step {step}" in train_log, train_log
        assert not (self.run_dir(job) / "REQUEUE").exists()
        return fields, step


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """The bundled dataset, prepared once for every job of this module (NFP4_DATA_CACHE)."""
    from data.prepare import prepare_from_config

    cache = tmp_path_factory.mktemp("slurm-data-cache")
    prepare_from_config(_compose([f"data.cache_dir={cache}"]).data)
    return cache


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """A throwaway Slurm cluster for this module; its daemons are stopped (by PID) afterwards."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm-cluster"))
    request.addfinalizer(c.stop)
    t0 = time.monotonic()
    c.start()
    print(f"\nslurm cluster up in {time.monotonic() - t0:.1f} s ({c.conf})")
    return c


@pytest.fixture(scope="module")
def jobs(cluster, data_cache, tmp_path_factory) -> Jobs:
    return Jobs(cluster, tmp_path_factory.mktemp("slurm-jobs"), data_cache)


@pytest.fixture(scope="module")
def reference(jobs) -> Path:
    """An uninterrupted 2-rank run through slurm/single_node.sbatch: its run dir."""
    t0 = time.monotonic()
    job = jobs.submit("single_node.sbatch", SINGLE, TRAIN)
    jobs.wait_done(job)
    print(f"\nreference job {job}: {time.monotonic() - t0:.1f} s")
    return jobs.run_dir(job)


# ----------------------------------------------------------------------------- launchers (no Slurm needed)


@pytest.mark.parametrize("name, target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_configs_compose(name, target):
    cfg = _compose([f"hydra/launcher={name}", "model=30m", "quant=bf16"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
    assert launcher.nodes == 1 and launcher.timeout_min > 0
    assert launcher.submitit_folder == "runs/multirun/.submitit/%j"  # ${hydra.sweep.dir}/.submitit/%j
    if name == "slurm":
        assert launcher.tasks_per_node == launcher.gpus_per_node == 8
        assert launcher.partition is None and launcher.max_num_timeout > 0 and launcher.signal_delay_s > 0
    else:
        assert launcher.tasks_per_node == 1
    # What submitit receives: every value resolved (the setup lines are shell, not interpolations).
    params = instantiate(launcher).params
    if name == "slurm":
        setup = "\n".join(params["setup"])
        assert "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in setup
        assert "export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK > 0 ? SLURM_CPUS_PER_TASK : 1 ))" in setup


def test_local_launcher_sweep(data_cache, tmp_path):
    """``python train.py -m hydra/launcher=local`` runs one submitit job per combination."""
    env = {**os.environ, "NFP4_DATA_CACHE": str(data_cache), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=local", "quant=bf16,quartet2", "train.steps=2",
           *[o for o in TRAIN if not o.startswith(("quant=", "train.steps="))], f"run_root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for scheme in ("bf16", "quartet2"):
        run_dir = tmp_path / "multirun" / f"tiny-{scheme}-2steps-s0"
        # The launching process prints a line per job as it starts and ends (training/sweep_progress.py).
        assert f"sweep: started tiny-{scheme}-2steps-s0 ({run_dir})" in proc.stdout, proc.stdout
        assert re.search(rf"sweep: finished tiny-{scheme}-2steps-s0: final validation loss \d+\.\d{{4}}", proc.stdout)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["scheme"] == scheme and math.isfinite(summary["final_val_loss"])
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows if "gap_step" not in r or "val/loss" in r] == [0, 1, 2]
        # The jobs run side by side: gaps to a bf16 run that ended later are filled in at the end
        # (Tracker.log_after) as rows of their own step, the step of the losses they compare.
        assert all("step" in r for r in rows) and all(r["step"] == r["gap_step"] for r in rows if "gap_step" in r), rows
    assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_result.pkl"))) == 2
    assert "sweep: 2 of 2 job(s) finished" in proc.stdout


# ----------------------------------------------------------------------------- the sbatch templates


def test_single_node_sbatch(reference):
    """slurm/single_node.sbatch: 2 srun tasks form one FSDP run that trains to the end."""
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2 and summary["scheme"] == "quartet2"
    rows = read_metrics(reference)
    assert [r["step"] for r in rows] == list(range(0, STEPS + 1))
    val, train = final_losses(reference)
    assert math.isfinite(val) and math.isfinite(train) and val < rows[1]["train/loss"]
    assert "2 rank(s) on cpu" in (reference / "train.log").read_text()
    assert (reference / ".hydra" / "config.yaml").is_file()  # Hydra's output dir is the run dir


def test_single_node_preempt_requeue_resume(jobs, reference):
    """USR1 to the batch shell: checkpoint, REQUEUE, ``scontrol requeue``, resume, same losses."""
    t0 = time.monotonic()
    job = jobs.submit("single_node.sbatch", SINGLE, TRAIN)
    _, step = jobs.preempt_and_finish(job)
    run_dir = jobs.run_dir(job)
    print(f"\npreempted job {job}: resumed at step {step}, {time.monotonic() - t0:.1f} s in all")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(0, STEPS + 1))
    assert final_losses(run_dir) == final_losses(reference)  # exactly: the resume is bit-exact


def test_scancel_ends_the_job(jobs):
    """``scancel`` (TERM to the batch shell and the ranks) cancels: no requeue, whatever the ranks do."""
    job = jobs.submit("single_node.sbatch", SINGLE, TRAIN)
    jobs.wait_checkpoint(job)
    jobs.cluster.cmd("scancel", job)
    jobs.cluster.wait(job, timeout=120)
    time.sleep(2)  # a requeue would show by now
    fields = jobs.cluster.job(job)
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", f"{fields}\n{jobs.log(job)}"
    assert "requeueing" not in jobs.log(job)


def test_multi_node_sbatch_preempt_requeue_resume(jobs, reference):
    """slurm/multi_node.sbatch on one node: torchrun with a c10d rendezvous on the head node, 2
    ranks; preempted and requeued like the single-node job, with the same final losses."""
    try:
        socket.gethostbyname(jobs.cluster.node)
    except OSError:
        pytest.skip(f"host name {jobs.cluster.node!r} does not resolve; torchrun's rendezvous needs it")
    t0 = time.monotonic()
    job = jobs.submit("multi_node.sbatch", MULTI, TRAIN, GPUS_PER_NODE="2")
    _, step = jobs.preempt_and_finish(job)
    print(f"\nmulti-node job {job}: resumed at step {step}, {time.monotonic() - t0:.1f} s in all")
    log = jobs.log(job)
    assert re.search(r"1 node\(s\) × 2 rank\(s\), rendezvous \S+:\d+", log), log
    assert final_losses(jobs.run_dir(job)) == final_losses(reference)


def test_slurm_launcher_sweep(jobs, cluster, tmp_path):
    """``python train.py -m hydra/launcher=slurm``: a 2-job array, each job 2 srun tasks."""
    env = {**cluster.env, **jobs.env}
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
           "quant=bf16,quartet2", "train.steps=2",
           *[o for o in TRAIN if not o.startswith(("quant=", "train.steps="))], f"run_root={tmp_path}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(f"\nslurm launcher sweep: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for scheme in ("bf16", "quartet2"):
        summary = json.loads((tmp_path / "multirun" / f"tiny-{scheme}-2steps-s0" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["world_size"] == 2 and summary["scheme"] == scheme
    script = next((tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR2@300" in script and "export MASTER_ADDR=" in script


# ----------------------------------------------------------------------------- data preparation


def _array_states(cluster: SlurmCluster, job: str, timeout: float = 300) -> list[dict[str, str]]:
    """Wait until no task of array job ``job`` is queued or running; each task's fields."""
    deadline = time.monotonic() + timeout
    while cluster.cmd("squeue", "-h", "-j", job, "-o", "%i", check=False).strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"array job {job} still queued after {timeout:.0f} s\n{cluster.logs()}")
        time.sleep(0.5)
    out = cluster.cmd("scontrol", "-o", "show", "job", job)
    return [parse_fields(line) for line in out.splitlines() if line.strip()]


def test_prepare_sbatch_array(cluster, tmp_path):
    """slurm/prepare.sbatch as an array of 3 one-CPU tasks (2 run at once on the 2-CPU node) on
    the bundled corpus split into 6 files: every task exits 0, the last one writes the manifest,
    and the directory is byte-identical to a one-process preparation."""
    from data.prepare import iter_documents, prepare
    from data.tokenizer import train_tokenizer

    chapters = list(iter_documents(REPO / "data" / "corpus" / "kjv.txt.xz"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"part{i}.txt").write_text("\n\n".join(chapters[i::6]) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer(chapters[:60], tmp_path / "tok.model", 512)
    args = [str(corpus), "--out", None, "--tokenizer", str(tokenizer.path), "--val-fraction", "0.02"]
    reference = prepare(tmp_path / "reference", tokenizer.path, [corpus], val_fraction=0.02, num_workers=1,
                        progress=False)
    out = tmp_path / "array"
    args[2] = str(out)
    env = {"PYTHON": sys.executable, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    job = cluster.sbatch([f"--output={tmp_path}/prepare-%A_%a.out", "--array=0-2", "--cpus-per-task=1",
                          "--time=10", "slurm/prepare.sbatch", *args], env=env, cwd=REPO)
    tasks = _array_states(cluster, job)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("prepare-*.out")))
    assert len(tasks) == 3 and {t["JobState"] for t in tasks} == {"COMPLETED"}, f"{tasks}\n{logs}"
    for k in range(3):
        assert f"part {k}/3, 1 CPU(s)" in logs and f"part {k}/3 done" in logs, logs
    assert logs.count("unit(s) unfinished of 6") <= 2 and "vocab_size 512, train" in logs, logs

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != ".lock"}

    assert files(out) == files(reference)
    assert len(list((out / "units").glob("*.bin"))) == 6
