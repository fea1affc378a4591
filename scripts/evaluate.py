"""Downstream evaluation of a trained model with lm-evaluation-harness.

    python scripts/evaluate.py export/<run>-hf --tasks hellaswag,arc_easy
    python scripts/evaluate.py runs/<run> --tasks arc_easy --limit 200 --out results/arc.md
    python scripts/evaluate.py model.pt --tasks my_task --include-path my_tasks/

MODEL is an exported Hugging Face folder (scripts/export_hf.py), a run directory, a DCP checkpoint
directory or a consolidated ``.pt`` (scripts/export_checkpoint.py); its tokenizer is found as
scripts/generate.py finds it. The model is scored by ``training.downstream.ModelLM`` (its docstring
gives the rules), unquantized; an NVFP4 folder (``export_hf.py --format nvfp4``) runs its weights
as compressed-tensors decompresses them, with unquantized activations (W4A16). Task data comes from
the Hugging Face Hub, or from local files through task YAMLs under ``--include-path``
(docs/evaluation.md). Writes the results as a markdown table to ``--out`` (default
``MODEL_NAME-eval.md`` in the working directory) and as JSON beside it, and prints the table. Bad
input (not a model, no tokenizer, an unknown task, task data unavailable offline) is one ``error:``
line and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data.tokenizer import Tokenizer, check_vocab  # noqa: E402
from inference.trained_model import find_tokenizer, load_checkpoint, pick_device  # noqa: E402
from training import downstream  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="exported folder, run directory, checkpoint or .pt")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", type=Path, help="a folder of task YAMLs of your own")
    p.add_argument("--limit", type=int, help="documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokenizer", type=Path, help="SentencePiece model file")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--out", type=Path, help="results table (.md; the .json goes beside it)")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Load the model, run the tasks, write and print the table; return the results."""
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("no task given. Fix: --tasks hellaswag,arc_easy (lm-eval task names).")
    downstream.check_tasks(tasks, downstream.task_manager(tasks, a.include_path))
    model, config, hf_tokenizer = load_checkpoint(a.model, pick_device(a.device))
    tokenizer = Tokenizer(find_tokenizer(a.tokenizer, hf_tokenizer, config))
    check_vocab(tokenizer, model.config.vocab_size)
    results = downstream.evaluate(model, tokenizer, tasks, include_path=a.include_path, limit=a.limit,
                                  num_fewshot=a.num_fewshot, batch_size=a.batch_size)
    out = downstream.write_results(results, a.out or Path(f"{a.model.resolve().name}-eval.md"))
    print(downstream.results_table(results))
    print(f"results: {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    a = parse_args(argv)
    try:
        run(a)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
