"""A run's identity: its token budget, its scheme label and its name.

Every place that names or matches runs takes these from here: train.yaml's ``run_name`` and
``run_group`` (the resolvers ``${budget:...}`` and ``${scheme_label:...}``, registered on import),
the checkpoint fingerprint and the baseline match (:data:`BUDGET_KEYS`), the trainer's step count
(:func:`total_steps`, the budget's one check) and ``analysis/`` (:func:`report_label`,
:func:`parse_run_name`).

The run name is ``<model>-<scheme label>-<budget>-s<seed>``:

* the budget is ``<T>tpp`` (``train.tokens_per_param``, SPEC §4's tokens per non-embedding
  parameter) or ``<N>steps`` (``train.steps``);
* the scheme label is the scheme's name, then ``+key=value`` for each ablation switch
  (:data:`quant.ABLATIONS`, SPEC §3) that changes the scheme on its own (:func:`scheme_switches`),
  then the precision recipe (:func:`precision_labels`): ``+tail=2`` or ``+tail=15%`` for
  ``bf16_tail``, ``+recipe=<6 hex digits>`` for the rules of ``recipe`` (a digest: globs hold
  characters a directory name should not), and the late switch as ``+fwdbf16@80%`` (a fraction of
  the budget) or ``+bf16@2400`` (a step). A switch set to what the scheme already does
  (``four_over_six=true`` on quartet2), or any switch or recipe on bf16, changes nothing and
  names nothing. The run group leaves the scheme out, so all of them share it.

The loss-gap report writes the same switches as ``scheme[key=value,...]`` (:func:`report_label`),
adding the layer choice ``keep_edge_blocks`` when it is set, which the run name leaves out.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

import quant

from .errors import ConfigError
from .precision_schedule import switch_label

BUDGET_KEYS = ("train.steps", "train.tokens_per_param")
"""The config keys that set a run's token budget (``tokens_per_param`` wins when both are set)."""

REPORT_LAYER_KEYS = ("keep_edge_blocks",)
"""Layer choices (:data:`quant.LAYER_KEYS`) that the report label names when they are set."""

RUN_NAME = re.compile(r"^(?P<model>[^-]+)-(?P<scheme>[^-+]+)(?P<switches>(?:\+[^-+]+)*)"
                      r"-(?P<budget>\d+(?:\.\d+)?(?:tpp|steps))-s(?P<seed>\d+)$")
"""train.yaml's ``run_name``: ``<model>-<scheme>[+<switch>=<value>...]-<budget>-s<seed>``."""


def _given(value: Any) -> bool:
    return value not in (None, "None", "null")


def budget_name(steps: Any, tokens_per_param: Any) -> str:
    """The budget part of a run name: ``25tpp`` or ``300steps``."""
    return f"{tokens_per_param}tpp" if _given(tokens_per_param) else f"{steps}steps"


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_budget(steps: Any, tokens_per_param: Any) -> None:
    """Raise :class:`ConfigError` unless exactly one budget is usable: ``tokens_per_param`` a
    positive number, or else ``steps`` a whole number ≥ 1."""
    fix = "a token budget, train.steps=N or train.tokens_per_param=T"
    if tokens_per_param is not None:
        if not isinstance(tokens_per_param, (int, float)) or not tokens_per_param > 0:
            raise ConfigError(
                f"train.tokens_per_param={tokens_per_param} must be a positive number of tokens per "
                f"parameter (the paper uses 25 to 800). Fix: train.tokens_per_param=T with T > 0, or "
                f"train.tokens_per_param=null and a step count train.steps=N."
            )
    elif steps is None:
        raise ConfigError(f"set {fix}")
    elif not positive_int(steps):
        raise ConfigError(f"train.steps={steps} must be a positive number of optimizer steps. Fix: {fix} "
                          f"(N ≥ 1 optimizer steps, or T > 0 tokens per non-embedding parameter).")


def total_steps(cfg: Any, non_embedding_params: int) -> int:
    """The token budget of a run config in optimizer steps: ``train.steps``, or
    ``⌈train.tokens_per_param × N / (train.batch_size × train.seq_len)⌉`` for N non-embedding
    parameters (SPEC §4)."""
    t = cfg.train
    check_budget(t.steps, t.tokens_per_param)
    if t.tokens_per_param is not None:
        tokens = t.tokens_per_param * non_embedding_params
        return max(1, math.ceil(tokens / (t.batch_size * t.seq_len)))
    return int(t.steps)


def scheme_switches(name: str, quant_cfg: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The ablation switches of ``quant_cfg`` (in :data:`quant.ABLATIONS` order) that change the
    scheme ``name`` on their own; none for a name that is not a scheme (the trainer refuses it)."""
    if name not in quant.SCHEMES:
        return []
    plain, switches = quant.get_scheme(name), []
    for key, default in quant.ABLATIONS.items():
        value = quant_cfg.get(key, default)
        if value == default:
            continue
        try:
            changes = quant.get_scheme(name, **{key: value}) != plain
        except ValueError:  # valid only with other switches: it changes the scheme
            changes = True
        if changes:
            switches.append((key, value))
    return switches


def precision_labels(name: str, quant_cfg: Mapping[str, Any]) -> list[str]:
    """The precision recipe and late switch of ``quant_cfg`` as name parts (module docstring);
    none on a scheme that quantizes nothing."""
    if name in quant.SCHEMES and quant.SCHEMES[name].is_identity:
        return []
    out = []
    tail = quant_cfg.get("bf16_tail")
    if tail:
        out.append(f"tail={tail * 100:g}%" if isinstance(tail, float) else f"tail={tail}")
    rules = quant_cfg.get("recipe")
    if rules:
        text = json.dumps([dict(r) for r in rules], sort_keys=True)
        out.append(f"recipe={hashlib.sha1(text.encode()).hexdigest()[:6]}")
    switch = switch_label(quant_cfg.get("schedule"))
    if switch:
        out.append(switch)
    return out


def run_label(quant_cfg: Mapping[str, Any]) -> str:
    """The scheme label of a run name: ``quartet2+eden_correction=energy``, ``quartet2+fwdbf16@80%``."""
    name = str(quant_cfg["name"])
    parts = [f"{k}={v}" for k, v in scheme_switches(name, quant_cfg)] + precision_labels(name, quant_cfg)
    return name + "".join(f"+{p}" for p in parts)


def _bracketed(name: str, switches: list[str]) -> str:
    return f"{name}[{','.join(switches)}]" if switches else name


def report_label(name: str | None, quant_cfg: Mapping[str, Any] | None) -> str | None:
    """The scheme label of the loss-gap report: ``quartet2[eden_correction=energy]``, the run
    label's switches and precision parts, and any :data:`REPORT_LAYER_KEYS` that are set; bf16
    keeps its bare name."""
    if name is None or not isinstance(quant_cfg, Mapping):
        return name
    if name in quant.SCHEMES and quant.SCHEMES[name].is_identity:
        return name
    switches = [f"{k}={v}" for k, v in scheme_switches(name, quant_cfg)] + precision_labels(name, quant_cfg)
    switches += [f"{k}={quant_cfg[k]}" for k in REPORT_LAYER_KEYS if quant_cfg.get(k) is not None]
    return _bracketed(name, switches)


@dataclass(frozen=True)
class RunName:
    """What a run name says (:data:`RUN_NAME`); ``scheme`` is the report label."""

    model: str
    scheme: str
    seed: int
    tokens_per_param: float | None
    steps: int | None


def parse_run_name(name: str) -> RunName | None:
    """The parts of a run name, or None when ``name`` is not one."""
    m = RUN_NAME.match(name)
    if not m:
        return None
    switches = m["switches"][1:].split("+") if m["switches"] else []
    budget = m["budget"]
    tpp = float(budget[:-3]) if budget.endswith("tpp") else None
    return RunName(model=m["model"], scheme=_bracketed(m["scheme"], switches), seed=int(m["seed"]),
                   tokens_per_param=tpp, steps=None if budget.endswith("tpp") else int(budget[:-5]))


OmegaConf.register_new_resolver("budget", budget_name, replace=True)
OmegaConf.register_new_resolver("scheme_label", run_label, replace=True)
