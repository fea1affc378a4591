"""Tests of downstream evaluation (training/downstream.py, scripts/evaluate.py and
train.downstream_eval_every) on a multiple-choice task defined from local files: no network."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from data.tokenizer import Tokenizer  # noqa: E402
from model import build_model  # noqa: E402
from scripts import evaluate as evaluate_cli  # noqa: E402
from training import errors, trainer
from training.run_dir import read_metrics  # noqa: E402

WORDS = "and the of to that in he shall unto for i his a lord they be is him not them".split()
TASK = "local_mc"


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The datasets cache in the test's own directory, and the Hub unreachable."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _task(folder: Path, n: int = 10, dataset: str | None = None) -> list[dict]:
    """A 4-way multiple-choice task of ``n`` random word sequences, as lm-eval YAML + jsonl."""
    rng = random.Random(0)
    docs = [{"question": " ".join(rng.choice(WORDS) for _ in range(8)),
             "choices": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)],
             "answer": rng.randrange(4)} for _ in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    source = (f"dataset_path: {dataset}\n" if dataset else
              f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n")
    (folder / "task.yaml").write_text(
        f"task: {TASK}\n{source}test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return docs


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The local task's folder (one for the module: lm-eval's task index is cached per folder)."""
    folder = tmp_path_factory.mktemp("tasks")
    return folder, _task(folder)


@pytest.fixture(scope="module")
def tokenizer(data_cache: Path) -> Tokenizer:
    return Tokenizer(next(data_cache.glob("sample-*/tokenizer.model")))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, compose_train, tokenizer: Tokenizer) -> Path:
    """A randomly initialised tiny model as scripts/export_checkpoint.py writes it."""
    cfg = compose_train(["model.max_seq_len=32"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    path = tmp_path_factory.mktemp("eval-model") / "model.pt"
    from omegaconf import OmegaConf
    torch.save({"model": model.state_dict(), "config": OmegaConf.to_container(cfg, resolve=True), "step": 0}, path)
    return path


def _direct_accuracy(model, tok: Tokenizer, docs: list[dict]) -> tuple[float, float]:
    """acc and acc_norm computed from the definition: a choice's score is the sum of the
    log-probabilities of its tokens after EOS + question (the space before the choice belongs to
    the choice); acc_norm divides it by the choice's length in characters (lm-eval's definition,
    without the space)."""
    hits = norm_hits = 0
    for doc in docs:
        ctx = tok.encode(doc["question"])
        scores = []
        for choice in doc["choices"]:
            whole = tok.encode(doc["question"] + " " + choice)
            tokens = [tok.eos_id] + whole
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([tokens[:-1]])).double(), -1)[0]
            cont = range(len(ctx) + 1, len(tokens))
            scores.append(sum(float(lp[i - 1, tokens[i]]) for i in cont))
        lengths = [len(c) for c in doc["choices"]]
        hits += max(range(4), key=lambda i: scores[i]) == doc["answer"]
        norm_hits += max(range(4), key=lambda i: scores[i] / lengths[i]) == doc["answer"]
    return hits / len(docs), norm_hits / len(docs)


def test_reported_accuracy_is_the_direct_computation(tmp_path: Path, checkpoint: Path, tokenizer: Tokenizer,
                                                     tasks, capsys) -> None:
    folder, docs = tasks
    out = tmp_path / "res.md"
    assert evaluate_cli.main([str(checkpoint), "--tasks", TASK, "--include-path", str(folder),
                              "--tokenizer", str(tokenizer.path), "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())[TASK]
    state = torch.load(checkpoint, weights_only=False)
    model = build_model(state["config"]["model"])
    model.load_state_dict(state["model"])
    acc, acc_norm = _direct_accuracy(model.eval(), tokenizer, docs)
    assert results["acc"] == pytest.approx(acc, abs=1e-12)
    assert results["acc_norm"] == pytest.approx(acc_norm, abs=1e-12)
    assert f"| {TASK} |" in out.read_text() and f"| {TASK} |" in capsys.readouterr().out


def test_bad_tasks_are_clear_errors(tmp_path: Path, checkpoint: Path, tokenizer: Tokenizer, tasks,
                                    capsys) -> None:
    base = [str(checkpoint), "--include-path", str(tasks[0]), "--tokenizer", str(tokenizer.path),
            "--device", "cpu", "--out", str(tmp_path / "r.md")]
    assert evaluate_cli.main([*base, "--tasks", "local_mcq"]) == 1
    err = capsys.readouterr().err
    assert "unknown lm-eval task(s) ['local_mcq']" in err and "local_mc" in err
    _task(tmp_path / "hub", dataset="nobody/no-such-dataset")
    assert evaluate_cli.main([*base[:1], "--include-path", str(tmp_path / "hub"), *base[3:], "--tasks", TASK]) == 1
    assert "could not be loaded" in capsys.readouterr().err
    assert evaluate_cli.main([str(tmp_path), "--tasks", TASK, "--include-path", str(tasks[0])]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "r.md").exists()


def test_downstream_eval_during_training(tiny, tasks) -> None:
    task_args = [f"train.downstream_tasks=[{TASK}]", f"train.downstream_include_path={tasks[0]}",
                 "train.downstream_limit=4", "quant=bf16"]
    cfg = tiny("train.steps=2", "train.eval_every=2", "train.downstream_eval_every=1", *task_args)
    trainer.run(cfg)
    rows = [r for r in read_metrics(Path(cfg.run_dir)) if f"eval/{TASK}/acc" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r[f"eval/{TASK}/acc"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in rows)
    with pytest.raises(errors.TrainingError, match="unknown lm-eval task"):
        trainer.run(tiny("train.steps=2", "train.downstream_eval_every=1", "train.downstream_tasks=[local_mcq]",
                       f"train.downstream_include_path={tasks[0]}", run="bad"))
