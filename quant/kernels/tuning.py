"""Launch tuning of the quantization kernels: one immutable :class:`KernelTuning`.

The tuning decides tile shapes, warps, tiles per program and which path an operand read across
memory rows takes. It never changes a result: every setting gives the reference's bits
(``tests/test_kernels.py`` runs the kernels under several), only the speed.

Set it from code with :func:`set_tuning` or :func:`use_tuning`, or from a configuration
section with :func:`tuning_from_mapping`::

    from quant.kernels import KernelTuning, set_tuning, tuning_from_mapping
    set_tuning(tuning_from_mapping({"tiles": {"rows": [16, 128, 4]}, "transpose_cols": True}))

Without a call, the kernels use :data:`GPU_TUNING`, or :data:`INTERPRETER_TUNING` under
triton's CPU interpreter (``TRITON_INTERPRET=1``, decided when the kernels are imported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .interpreter import interpreting

LAYOUTS = ("rows", "rows_2d", "rows_wide", "rows_eden", "cols", "cols_wide", "cols_groups",
           "cols_eden")
"""The operand layouts that have their own tile (``ops.layout_of`` picks one per operand):

* ``rows``: ``A``'s rows are contiguous (groups of 16 along memory);
* ``rows_2d``: the same with 16×16 scale tiles (the kernel takes 16 rows whatever BM says);
* ``rows_wide``: rows rotated in chunks of 32 or more, whose butterfly stages across groups stay
  inside one warp only when a warp's lanes cover the rows and groups of its tile;
* ``rows_eden``: the same under MS-EDEN;
* ``cols``, ``cols_wide``: ``A`` read across memory rows (``A = Xᵀ``, or a transposed packed
  tensor), loaded in memory order ``[BK, BM]`` and transposed on chip (rotations of up to 16,
  and over 16); BM ≥ 16, as a packed tile holds whole 16-groups of its rows. They serve only
  when :attr:`KernelTuning.transpose_cols` is off;
* ``cols_groups``, ``cols_eden``: ``A`` read across memory rows by the quantizers that hold whole
  16-groups per thread (``ops.whole_groups``), loaded by row-wise slices joined in registers
  (``triton_kernels._load_groups_cols``); BM ≥ 2, as a packed byte holds two rows.

BK is raised to the rotation size where it is smaller."""

SOURCES = ("dense", "packed", "packed_2d")
"""Source kinds of an operand, in the order of ``ops.SRC_DENSE``, ``SRC_PACKED``, ``SRC_PACKED_2D``."""

Tile = tuple[int, int, int]
"""``(BM, BK, warps)``: rows and columns of a tile of the logical operand, and warps per program."""

GPU_TILES: Mapping[str, Tile] = MappingProxyType({
    "rows": (8, 128, 2), "rows_2d": (16, 128, 8), "rows_wide": (8, 128, 1),
    "rows_eden": (4, 128, 1), "cols": (32, 64, 4), "cols_wide": (16, 128, 4),
    "cols_groups": (8, 128, 1), "cols_eden": (8, 128, 1)})
"""The tiles per layout on a GPU, from the H200 sweeps of ``scripts/bench_kernels.py --sweep``
and offline sm_90 register reports (``scripts/kernel_report.py``); H200, triton 3.6,
16384×4096 BF16, 2026-11:

* ``rows`` (8, 128, 2), looping over 4 tiles per program: RTN 1×16 146.1 µs against 162.8 with
  one (16, 128, 4) tile per program;
* ``rows_wide`` (8, 128, 1): each thread holds two 16-groups; RHT32+SR 202.8 µs against 212.8
  with 4 rows;
* ``rows_eden`` (4, 128, 1): one group per thread; post hoc MS-EDEN 147.4 µs against 170.0 with
  8 rows, whose 168 registers cost more than their fewer instructions per element save;
* ``rows_2d`` (16, 128, 8); ``cols_groups`` and ``cols_eden`` (8, 128, 1)."""

GPU_TILES_PER_PROGRAM: Mapping[str, int] = MappingProxyType({
    "rows": 4, "rows_2d": 1, "rows_wide": 4, "rows_eden": 4, "cols": 1, "cols_wide": 1,
    "cols_groups": 4, "cols_eden": 4})
"""Consecutive tiles (along K, then M) that one program quantizes in a loop, per layout (1: a
2-D grid of one tile per program). A loop loads the Hadamard signs and the Philox key and issues
the post hoc ``atomic_max`` once per program. H200, triton 3.6, 16384×4096, 2026-11, µs, 4 tiles
per program against 1: post hoc MS-EDEN rows 162.3 against 174.3 (8 and 32 were slower than 4);
sliced columns RHT16+RTN 202.6 against 214.6, RTN+4/6 269.3 against 303.1; post hoc MS-EDEN
columns at 16384×3072 114.3 against 116.5 (its four tiles share their draws,
``triton_kernels._eden_draw``)."""


def _uniform(tile: Any) -> dict[str, Any]:
    return {layout: tile for layout in LAYOUTS}


@dataclass(frozen=True)
class KernelTuning:
    """How the quantization kernels launch; every setting gives the same bits.

    Fields and their defaults (:data:`GPU_TUNING`):

    * ``tiles``: ``(BM, BK, warps)`` per layout of :data:`LAYOUTS`, default :data:`GPU_TILES`:
      rows (8, 128, 2), rows_2d (16, 128, 8), rows_wide (8, 128, 1), rows_eden (4, 128, 1),
      cols (32, 64, 4), cols_wide (16, 128, 4), cols_groups (8, 128, 1), cols_eden (8, 128, 1).
      BM, BK and warps are powers of two, BK a multiple of 16, BM ≥ 16 for ``cols`` and
      ``cols_wide``, BM ≥ 2 for ``cols_groups`` and ``cols_eden``;
    * ``tiles_per_program``: per layout, default :data:`GPU_TILES_PER_PROGRAM`: 4 for rows,
      rows_wide, rows_eden, cols_groups and cols_eden, 1 for rows_2d, cols and cols_wide;
    * ``transpose_cols`` (True): an operand read across memory rows that is not loaded by
      slices is first made contiguous by ``transpose_kernel`` (one coalesced read and write)
      and quantized along rows; False: the quantization kernel transposes it on chip (the
      ``cols`` layouts). On an H200 with triton 3.6 (2026-11), over the ten kernels of
      ``scripts/bench_kernels.py`` at their best column tiles, the on-chip transpose took 4742
      µs against 2975 µs transposing first;
    * ``sliced_sources`` (``("dense",)``): the source kinds (:data:`SOURCES`) whose column
      operands the whole-group quantizers load by row-wise slices, with no transpose at all;
      the others take the path of ``transpose_cols``. Packed sources are transposed first: a
      thread of the slices would hold one group of each of two rows (a byte holds two), every
      butterfly stage would cross lanes and decoding adds about 13 SASS instructions per
      element (H200, 2026-11: quartet2's X̂ᵀ at 16384×1024 52.4 µs against 59.2 sliced; SR
      from a packed source at 16384×4096 274.7 against 311.1);
    * ``transpose_tile`` ((64, 64, 4)): ``(BM, BK, warps)`` of ``transpose_kernel``;
    * ``align_tile`` ((32, 8, 4)): ``(rows, groups of 16, warps)`` of the tiles of MS-EDEN's post
      hoc align pass when it writes the packed form's scales;
    * ``align_programs_per_sm`` (4): that pass's programs per SM (they stride over its tiles);
    * ``align_minima`` ((128, 8)): the first-pass programs whose least positive corrected scale
      one align program reads when it writes no scales, and its warps. H200, 16384×3072 rows,
      2026-11: 1.7–2.0 µs with nothing to fix, 7.7 with every 512th row 2^-30 below the rest
      in its first 1024 columns; (32, 1) took 29.6 with such rows, (32, 4) 9.5.

    Tables may name only some layouts: the others keep their :data:`GPU_TUNING` entry.
    """

    tiles: Mapping[str, Tile] = field(default_factory=lambda: GPU_TILES)
    tiles_per_program: Mapping[str, int] = field(default_factory=lambda: GPU_TILES_PER_PROGRAM)
    transpose_cols: bool = True
    sliced_sources: tuple[str, ...] = ("dense",)
    transpose_tile: Tile = (64, 64, 4)
    align_tile: Tile = (32, 8, 4)
    align_programs_per_sm: int = 4
    align_minima: tuple[int, int] = (128, 8)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tiles = _table("tiles", self.tiles, GPU_TILES, _tile)
        for layout, (bm, _, _) in tiles.items():
            if layout in ("cols", "cols_wide") and bm < 16:
                raise ValueError(f"tiles[{layout!r}]: column layouts need BM >= 16 (whole "
                                 f"16-groups of a packed row), got {bm}")
            if layout in ("cols_groups", "cols_eden") and bm < 2:
                raise ValueError(f"tiles[{layout!r}]: sliced column layouts need BM >= 2 (a "
                                 f"packed byte holds two rows), got {bm}")
        per_program = _table("tiles_per_program", self.tiles_per_program, GPU_TILES_PER_PROGRAM,
                             _positive)
        sliced = tuple(self.sliced_sources)
        unknown = [s for s in sliced if s not in SOURCES]
        if unknown:
            raise ValueError(f"sliced_sources: unknown source kinds {unknown}; choose from {SOURCES}")
        values = dict(tiles=tiles, tiles_per_program=per_program, sliced_sources=sliced,
                      transpose_cols=bool(self.transpose_cols),
                      transpose_tile=_tile("transpose_tile", self.transpose_tile),
                      align_tile=_triple("align_tile", self.align_tile),
                      align_programs_per_sm=_positive("align_programs_per_sm",
                                                      self.align_programs_per_sm),
                      align_minima=tuple(_positive("align_minima", v) for v in self.align_minima))
        if len(values["align_minima"]) != 2:
            raise ValueError(f"align_minima: expected (programs, warps), got {self.align_minima!r}")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(tuple(
            tuple(v.items()) if isinstance(v, Mapping) else v for v in values.values())))

    def __hash__(self) -> int:
        return self._hash


def _table(name: str, given: Mapping[str, Any], defaults: Mapping[str, Any], check) -> Mapping:
    unknown = sorted(set(given) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"{name}: unknown layouts {unknown}; the layouts are {list(LAYOUTS)}")
    merged = {layout: check(f"{name}[{layout!r}]", given.get(layout, defaults[layout]))
              for layout in LAYOUTS}
    return MappingProxyType(merged)


def _triple(name: str, value: Any) -> Tile:
    try:
        t = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected three integers, got {value!r}") from None
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"{name}: expected three positive integers, got {value!r}")
    return t


def _tile(name: str, value: Any) -> Tile:
    t = _triple(name, value)
    bm, bk, warps = t
    if bk % 16 or any(v & (v - 1) for v in t):
        raise ValueError(f"{name}: BM, BK and the warps must be powers of two, BK a multiple of "
                         f"16, got {value!r}")
    return t


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


GPU_TUNING = KernelTuning()
"""The tuning on a GPU (the defaults of :class:`KernelTuning`)."""

INTERPRETER_TUNING = KernelTuning(
    tiles=_uniform((128, 256, 4)), tiles_per_program=_uniform(2), transpose_cols=False,
    align_tile=(128, 16, 4))
"""The tuning under triton's CPU interpreter, which runs about 8 ms per program instance: large
tiles for every layout; 2 tiles per program, so that the loop and a program's partial last tile
are tested; column operands on the kernels' own column paths (the slices, the on-chip
transpose), which the GPU's default leaves to the transpose pass."""

FIELDS = tuple(f.name for f in dataclasses.fields(KernelTuning) if f.init)
"""The keys :func:`tuning_from_mapping` accepts."""


_DEFAULT = INTERPRETER_TUNING if interpreting() else GPU_TUNING


def default_tuning() -> KernelTuning:
    """:data:`INTERPRETER_TUNING` when the kernels run under triton's interpreter
    (``TRITON_INTERPRET=1`` when they were imported), else :data:`GPU_TUNING`."""
    return _DEFAULT


def tuning_from_mapping(d: Mapping[str, Any], base: KernelTuning | None = None) -> KernelTuning:
    """A :class:`KernelTuning` from a mapping of its fields (e.g. a Hydra config section):
    ``base`` (default :func:`default_tuning`) with the fields of ``d`` replaced; the tables
    ``tiles`` and ``tiles_per_program`` are replaced layout by layout. Lists stand for tuples.
    An unknown key raises ``ValueError`` naming it and the accepted keys (:data:`FIELDS`)."""
    base = default_tuning() if base is None else base
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown kernel tuning keys {unknown}; accepted keys: {list(FIELDS)}")
    changes: dict[str, Any] = {}
    for key, value in d.items():
        if key in ("tiles", "tiles_per_program"):
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}: expected a mapping of layouts, got {value!r}")
            changes[key] = {**getattr(base, key), **value}
        elif key == "sliced_sources" and isinstance(value, str):
            raise ValueError(f"sliced_sources: expected a list of source kinds, got {value!r}")
        else:
            changes[key] = value
    return dataclasses.replace(base, **changes)


_current: KernelTuning | None = None


def get_tuning() -> KernelTuning:
    """The tuning in use: the last :func:`set_tuning`, else :func:`default_tuning`."""
    return _DEFAULT if _current is None else _current


def set_tuning(tuning: KernelTuning | None) -> None:
    """Use ``tuning`` from the next launch on; ``None`` goes back to :func:`default_tuning`."""
    global _current
    if tuning is not None and not isinstance(tuning, KernelTuning):
        raise TypeError(f"expected a KernelTuning, got {type(tuning).__name__}")
    _current = tuning


@contextmanager
def use_tuning(tuning: KernelTuning) -> Iterator[KernelTuning]:
    """Use ``tuning`` inside the ``with`` block, then the tuning in use before."""
    old = _current
    set_tuning(tuning)
    try:
        yield tuning
    finally:
        set_tuning(old)
