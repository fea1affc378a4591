"""Downstream evaluation with lm-evaluation-harness, on the framework's own model.

:class:`ModelLM` is an ``lm_eval`` language model backed by a :class:`model.llama.Llama` and the
run's SentencePiece tokenizer, so that scripts/evaluate.py and ``train.downstream_eval_every``
evaluate without converting the model. Its scoring follows lm-eval's Hugging Face model:

- ``loglikelihood(context, continuation)``: trailing spaces of the context move to the
  continuation; ``whole = encode(context + continuation)``, ``ctx = encode(context)``, and the
  continuation's tokens are ``whole[len(ctx):]``. The input is ``[BOS] + whole`` without its last
  token, cut to the model's last ``max_seq_len`` positions; the score is the sum of the
  continuation tokens' log-probabilities, and ``is_greedy`` says whether each was the argmax.
- ``loglikelihood_rolling(text)``: ``[BOS] + encode(text)`` in disjoint windows of ``max_seq_len``
  predicted tokens, each window conditioned on the ``max_seq_len`` tokens before its first target
  (fewer at the start); the sum of every token's log-probability.
- ``generate_until``: greedy decoding (model.sampling) until a stop string or ``max_gen_toks``.

The model is evaluated as it is: exported weights are the high-precision master weights, so an
unquantized model here scores what an exported folder scores.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from data.tokenizer import Tokenizer
from model.llama import Llama

try:
    from lm_eval.api.model import LM
except ImportError:  # the class is only defined where lm-eval is installed
    LM = object


def _require_lm_eval() -> None:
    if LM is object:
        raise ImportError(
            "downstream evaluation needs lm-evaluation-harness: pip install lm-eval "
            "(requirements.txt pins it)."
        )


class ModelLM(LM):
    """lm-eval's LM interface over a framework model (module docstring for the scoring rules)."""

    def __init__(self, model: Llama, tokenizer: Tokenizer, batch_size: int = 8) -> None:
        _require_lm_eval()
        super().__init__()
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.max_len = model.config.max_seq_len
        self._device = next(model.parameters()).device

    @torch.no_grad()
    def _logprobs(self, rows: Sequence[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary at every position of each row (rows padded right)."""
        out: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            width = max(len(r) for r in batch)
            idx = torch.zeros(len(batch), width, dtype=torch.long)
            for i, r in enumerate(batch):
                idx[i, : len(r)] = torch.tensor(r)
            logits = self.model(idx.to(self._device)).float()
            lp = F.log_softmax(logits, dim=-1).cpu()
            out.extend(lp[i, : len(r)] for i, r in enumerate(batch))
        return out

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context) if context else []
        return whole[: len(ctx)], whole[len(ctx) :]

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        rows, targets = [], []
        for req in requests:
            ctx, cont = self._split(*req.args)
            tokens = [self.tok.eos_id] + ctx + cont
            window = tokens[-(self.max_len + 1) :]
            rows.append(window[:-1])
            targets.append(cont[-(len(window) - 1) :] if cont else [])
        results = []
        for lp, cont in zip(self._logprobs(rows), targets):
            picked = lp[len(lp) - len(cont) :]
            ids = torch.tensor(cont, dtype=torch.long)
            score = float(picked.gather(1, ids[:, None]).sum()) if cont else 0.0
            greedy = bool((picked.argmax(-1) == ids).all()) if cont else True
            results.append((score, greedy))
        return results

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        results = []
        for req in requests:
            tokens = [self.tok.eos_id] + self.tok.encode(req.args[0])
            rows, spans = [], []
            for first in range(1, len(tokens), self.max_len):
                last = min(first + self.max_len, len(tokens))
                begin = max(0, last - 1 - self.max_len)
                rows.append(tokens[begin : last - 1])
                spans.append((first - begin - 1, tokens[first:last]))
            total = 0.0
            for lp, (offset, target) in zip(self._logprobs(rows), spans):
                ids = torch.tensor(target, dtype=torch.long)
                total += float(lp[offset : offset + len(target)].gather(1, ids[:, None]).sum())
            results.append(total)
        return results

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        from model.sampling import generate

        outputs = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompt = [self.tok.eos_id] + self.tok.encode(context)
            new = generate(
                self.model, prompt, int(kwargs.get("max_gen_toks", 64)), temperature=0.0,
                eos_id=self.tok.eos_id,
            )
            text = self.tok.decode(new)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs


@functools.lru_cache(maxsize=8)
def _manager(include_path: str | None, defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None) -> Any:
    """lm-eval's TaskManager for ``tasks``: the task YAMLs under ``include_path`` alone when they
    define every task (indexing lm-eval's own ~15,000 tasks takes about 12 s), else those plus
    lm-eval's own. Cached per folder."""
    _require_lm_eval()
    if include_path is not None:
        local = _manager(str(include_path), False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return _manager(str(include_path) if include_path else None, True)


def check_tasks(tasks: Sequence[str], manager: Any) -> None:
    """ValueError naming each unknown task, with lm-eval's nearest names and the local-task fix."""
    import difflib

    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        raise ValueError(
            f"unknown lm-eval task(s) {unknown} (nearest: {hints}). Use a task name lm-eval knows "
            "(python -m lm_eval ls tasks), or define one in a YAML file and pass its folder "
            "(--include-path / train.downstream_include_path)."
        )


def evaluate(
    model: Llama,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    *,
    include_path: str | Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Run lm-eval's ``tasks`` on ``model``; return ``{task: {metric: value}}``.

    Metric names are lm-eval's without the filter suffix (``acc``, ``acc_norm``, ``acc_stderr``,
    ...). ValueError for unknown tasks; ConnectionError, naming the task and the fix, when a task's
    data cannot be had (no network and no local cache)."""
    manager = task_manager(tasks, include_path)
    check_tasks(tasks, manager)
    import lm_eval

    was_training = model.training
    model.eval()
    try:
        out = lm_eval.simple_evaluate(
            model=ModelLM(model, tokenizer, batch_size), tasks=list(tasks), task_manager=manager,
            limit=limit, num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0,
        )
    except (ConnectionError, OSError) as err:
        raise ConnectionError(
            f"the data of task(s) {list(tasks)} could not be loaded: {err}. lm-eval downloads task "
            "data from the Hugging Face Hub; without network, use a machine where the datasets "
            "cache (HF_DATASETS_CACHE) already holds them, or define a task on local files "
            "(docs/evaluation.md)."
        ) from err
    finally:
        model.train(was_training)
    return {task: _metrics(values) for task, values in out["results"].items()}


def _metrics(values: Mapping[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in values.items():
        name = key.split(",")[0]
        if name == "sample_len":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "alias":
            if not (isinstance(value, float) and math.isnan(value)):
                metrics[name] = float(value)
    return metrics


def results_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table: one row per task, one column per metric (stderr beside its metric)."""
    names = sorted({m for r in results.values() for m in r if not m.endswith("_stderr")})
    lines = ["| task | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for task, metrics in sorted(results.items()):
        cells = []
        for name in names:
            if name not in metrics:
                cells.append("")
                continue
            err = metrics.get(f"{name}_stderr")
            cells.append(f"{metrics[name]:.4f}" + (f" ± {err:.4f}" if err else ""))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(results: Mapping[str, Mapping[str, float]], out: str | Path) -> Path:
    """``out`` (markdown table) and ``out`` with suffix ``.json`` (the same numbers)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(results_table(results) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return out
