"""Per-module precision recipes: which GEMMs of which linear layer run under the scheme.

A recipe is an ordered list of rules, each a module pattern and a precision; the first rule that
matches a linear's qualified name (``blocks.3.attn.qkv``, ``lm_head``) gives its precision, and a
linear that no rule matches gets the scheme (Megatron-Core's per-module recipes, where the first
match wins). The precisions (:data:`PRECISIONS`):

* ``scheme``: the run's scheme on all three GEMMs;
* ``bf16``: all three GEMMs in high precision; the layer stays an ``nn.Linear`` (what
  ``quant.skip`` did);
* ``bf16_forward``: the forward GEMM ``Y = X Wᵀ`` unquantized (X and W in the compute dtype), the
  backward GEMMs as the scheme says (:func:`quant.schemes.bf16_gemms`);
* ``bf16_backward``: dgrad and wgrad unquantized on what the layer saved, the forward quantized.

Patterns are ``fnmatch`` globs over the qualified names, plus block ranges in braces that count
from the end as well as from the start: ``{i}`` is block ``i``, ``{a..b}`` blocks ``a`` through
``b`` inclusive, either end may be left out, a negative index counts from the number of blocks
(``-1`` is the last one), and commas join ranges. ``blocks.{-2..}.*`` is every linear of the last
two blocks, ``blocks.{..1,-8..}.*`` NVIDIA's first 2 and last 8 (arXiv 2509.25149),
``blocks.*.attn.*`` every attention projection.

The layer choices of a quant config (configs/quant/base/switches.yaml) are cases of a recipe,
translated into BF16 rules ahead of its own ``recipe`` list (:func:`recipe_from_config`): ``skip``
and ``keep_edge_blocks`` (their patterns, :func:`quant.linear.skip_patterns_by_key`) and ``bf16_tail``,
the last N blocks (an int) or the last fraction of them (a float in (0, 1], rounded up to whole
blocks: Nemotron 3 keeps its last ~15% in BF16). A config without ``recipe`` and ``bf16_tail``
therefore quantizes the very layers it did before, with the same layer indices
(:func:`quantize_with_recipe` swaps them with :func:`quant.linear.quantize_model`).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from .linear import QuantLinear, check_linear_shape, quantize_model, skip_patterns_by_key
from .schemes import Scheme, bf16_gemms

PRECISIONS = ("scheme", "bf16", "bf16_forward", "bf16_backward")
"""What a recipe rule can give a linear (module docstring)."""

BLOCKS = "blocks"
"""The module list whose indices the brace ranges count (model/llama.py's ``Llama.blocks``)."""

_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^\s*(-?\d+)?\s*(\.\.)?\s*(-?\d+)?\s*$")


class RecipeError(ValueError):
    """A recipe that cannot be applied; the message names the rule and the fix."""


def block_indices(spec: str, n_blocks: int, where: str = "") -> list[int]:
    """The block indices of a brace range's inside (``-2..``, ``0..1,-8..``, ``3``), sorted, for
    a model of ``n_blocks`` blocks (module docstring). An index outside the model is refused."""
    out: set[int] = set()
    for part in spec.split(","):
        m = _RANGE.match(part)
        if not m or (m[1] is None and m[3] is None) or (m[2] is None and m[3] is not None):
            raise RecipeError(f"{where}block range {{{spec}}}: {part.strip()!r} is not i, a..b, a.. or ..b "
                              f"(negative counts from the end: {{-2..}} is the last two blocks)")
        ends = [int(v) for v in (m[1], m[3]) if v is not None]
        for v in ends:
            if not -n_blocks <= v < n_blocks:
                raise RecipeError(f"{where}block range {{{spec}}}: block {v} does not exist in a model of "
                                  f"{n_blocks} blocks (0..{n_blocks - 1}, or -{n_blocks}..-1 from the end)")
        first = int(m[1]) % n_blocks if m[1] is not None else 0
        last = (int(m[3]) % n_blocks if m[3] is not None else n_blocks - 1) if m[2] else first
        out |= set(range(first, last + 1))
    return sorted(out)


def expand(pattern: str, n_blocks: int, where: str = "") -> list[str]:
    """``pattern`` as plain ``fnmatch`` patterns: each brace range replaced by each of its block
    indices (a pattern whose ranges are empty, ``{3..1}``, expands to none)."""
    pieces = _BRACES.split(pattern)
    literals, ranges = pieces[0::2], pieces[1::2]
    choices = [block_indices(r, n_blocks, where) for r in ranges]
    out = []
    for combo in itertools.product(*choices):
        out.append(literals[0] + "".join(f"{i}{lit}" for i, lit in zip(combo, literals[1:])))
    return out


@dataclass(frozen=True)
class Rule:
    """One recipe rule: the linears whose names match ``modules`` get ``precision``; ``origin``
    is the config entry it comes from, for messages."""

    modules: str
    precision: str
    origin: str = "quant.recipe"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise RecipeError(f"{self.origin}: unknown precision {self.precision!r} for modules "
                              f"{self.modules!r}; choose one of {', '.join(PRECISIONS)}")


class Recipe:
    """Rules in order (first match wins) for a model of ``n_blocks`` blocks; a bad block range
    is refused here, naming its rule."""

    def __init__(self, rules: Sequence[Rule], n_blocks: int) -> None:
        self.rules, self.n_blocks = tuple(rules), n_blocks
        self._patterns = [expand(r.modules, n_blocks, f"{r.origin}: ") for r in self.rules]

    def _matches(self, i: int, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self._patterns[i])

    def precision_of(self, name: str) -> str:
        """The precision of the linear ``name``: its first matching rule's, else ``scheme``."""
        return next((r.precision for i, r in enumerate(self.rules) if self._matches(i, name)), "scheme")

    def assign(self, names: Sequence[str]) -> dict[str, str]:
        """``{name: precision}`` for the linears ``names``; a ``quant.recipe`` rule that matches
        none of them is refused, naming it and some names it could match."""
        for i, rule in enumerate(self.rules):
            if rule.origin.startswith("quant.recipe") and not any(self._matches(i, n) for n in names):
                shown = ", ".join(list(names)[:6]) + (", ..." if len(names) > 6 else "")
                raise RecipeError(f"{rule.origin}: modules {rule.modules!r} matches no linear layer of the "
                                  f"model (they are named like {shown}). Fix: correct the pattern (globs over "
                                  f"qualified names, block ranges like blocks.{{-2..}}.*), or drop the rule.")
        return {n: self.precision_of(n) for n in names}


def tail_blocks(tail: Any, n_blocks: int) -> int:
    """How many of the last blocks ``bf16_tail`` keeps in BF16: an int N (0 ≤ N ≤ n_blocks), or a
    fraction in (0, 1] of the blocks, rounded up (``0.15`` of 12 blocks is 2)."""
    fix = "Fix: quant.bf16_tail=N (a number of blocks) or a fraction in (0, 1], e.g. 0.15, or null."
    if isinstance(tail, bool) or not isinstance(tail, (int, float)):
        raise RecipeError(f"quant.bf16_tail={tail!r} is neither a number of blocks nor a fraction. {fix}")
    if isinstance(tail, int):
        if not 0 <= tail <= n_blocks:
            raise RecipeError(f"quant.bf16_tail={tail}: the model has {n_blocks} blocks. {fix}")
        return tail
    if not 0 < tail <= 1:
        raise RecipeError(f"quant.bf16_tail={tail} is not a fraction in (0, 1]. {fix}")
    return math.ceil(round(tail * n_blocks, 9))


def recipe_from_config(quant_cfg: Mapping[str, Any], n_blocks: int, default_skip: Sequence[str] = ()) -> Recipe:
    """The recipe of a quant config (configs/quant/): BF16 rules for ``skip`` (``default_skip``,
    the scheme's own, when absent or null), ``keep_edge_blocks`` and ``bf16_tail``, then the
    ``recipe`` list's rules, each ``{modules: <pattern>, precision: <one of PRECISIONS>}``."""
    rules = [Rule(p, "bf16", key) for key, p in skip_patterns_by_key(quant_cfg, n_blocks, default_skip)]
    tail = quant_cfg.get("bf16_tail")
    if tail is not None and (n := tail_blocks(tail, n_blocks)):
        rules.append(Rule(f"{BLOCKS}.{{-{n}..}}.*", "bf16", "quant.bf16_tail"))
    for i, entry in enumerate(quant_cfg.get("recipe") or ()):
        where = f"quant.recipe[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"modules", "precision"}:
            raise RecipeError(f"{where}={entry!r} must be {{modules: <pattern>, precision: <precision>}}, e.g. "
                              f"{{modules: 'blocks.*.attn.*', precision: bf16}}")
        rules.append(Rule(str(entry["modules"]), str(entry["precision"]), where))
    return Recipe(tuple(rules), n_blocks)


def scheme_for(scheme: Scheme, precision: str) -> Scheme:
    """The scheme a linear under ``precision`` runs (``bf16``: none of its GEMMs quantized)."""
    if precision not in PRECISIONS:
        raise RecipeError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "scheme":
        return scheme
    return bf16_gemms(scheme, forward=precision in ("bf16", "bf16_forward"),
                      backward=precision in ("bf16", "bf16_backward"))


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the plain ``nn.Linear`` modules of ``model``, in module order."""
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


def quantize_with_recipe(model: nn.Module, scheme: Scheme, recipe: Recipe) -> dict[str, str]:
    """Swap the linears of ``model`` (in place) as ``recipe`` says: the ``bf16`` ones stay
    ``nn.Linear``, the others become :class:`~quant.linear.QuantLinear` under
    :func:`scheme_for` their precision, numbered as :func:`~quant.linear.quantize_model` numbers
    them. Returns ``{name: precision}`` of every linear."""
    precisions = recipe.assign(linear_names(model))
    quantize_model(model, scheme, skip=[n for n, p in precisions.items() if p == "bf16"])
    for m in model.modules():
        if isinstance(m, QuantLinear) and (s := scheme_for(scheme, precisions[m.layer_name])) != m.scheme:
            check_linear_shape(m.layer_name, m.in_features, m.out_features, s)
            m.scheme = s
    return precisions


def quant_linears(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def set_precision(model: nn.Module, precision: str) -> int:
    """Every :class:`~quant.linear.QuantLinear` of ``model`` from now on runs its scheme under
    ``precision`` as well (``bf16_forward``: its forward GEMM in BF16, whatever its backward
    does); returns how many layers changed."""
    changed = 0
    for m in quant_linears(model):
        s = scheme_for(m.scheme, precision)
        changed += s != m.scheme
        m.scheme = s
    return changed


@contextmanager
def schemes_replaced(model: nn.Module, replace: Callable[[Scheme], Scheme]) -> Iterator[int]:
    """Within the block every QuantLinear of ``model`` runs ``replace(its scheme)``; yields their
    number. Their schemes are restored on exit."""
    layers = quant_linears(model)
    saved = [m.scheme for m in layers]
    for m in layers:
        m.scheme = replace(m.scheme)
    try:
        yield len(layers)
    finally:
        for m, s in zip(layers, saved):
            m.scheme = s


def bf16_linears(model: nn.Module) -> AbstractContextManager[int]:
    """:func:`schemes_replaced` with every GEMM of every quantized linear in BF16 (what the model
    computes with the same weights and no quantization: the ``val/loss_bf16`` of a run)."""
    return schemes_replaced(model, lambda s: scheme_for(s, "bf16"))
