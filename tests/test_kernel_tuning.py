"""The kernels' launch tuning (quant/kernels/tuning.py): its defaults, its validation, and that a
tuning set from code decides the launches. Cheap: no kernel runs."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

from quant.kernels import (  # noqa: E402
    KernelTuning,
    get_tuning,
    ops,
    set_tuning,
    tuning_from_mapping,
    use_tuning,
)
from quant.kernels import tuning as tuning_mod  # noqa: E402
from quant.kernels.tuning import FIELDS, GPU_TUNING, INTERPRETER_TUNING, LAYOUTS  # noqa: E402


def test_defaults_are_the_kernels_tiles():
    """The GPU defaults: the tiles, tiles per program, column paths and align pass that the
    kernels were measured and verified with (docs/performance.md, "Design")."""
    t = KernelTuning()
    assert t == GPU_TUNING
    assert dict(t.tiles) == {
        "rows": (8, 128, 2), "rows_2d": (16, 128, 8), "rows_wide": (8, 128, 1),
        "rows_eden": (4, 128, 1), "cols": (32, 64, 4), "cols_wide": (16, 128, 4),
        "cols_groups": (8, 128, 1), "cols_eden": (8, 128, 1)}
    assert dict(t.tiles_per_program) == {
        "rows": 4, "rows_2d": 1, "rows_wide": 4, "rows_eden": 4, "cols": 1, "cols_wide": 1,
        "cols_groups": 4, "cols_eden": 4}
    assert t.transpose_cols is True and t.sliced_sources == ("dense",)
    assert t.transpose_tile == (64, 64, 4) and t.align_tile == (32, 8, 4)
    assert t.align_programs_per_sm == 4 and t.align_minima == (128, 8)


def test_interpreter_defaults():
    """Under the interpreter: large tiles everywhere, 2 tiles per program, the kernels' own column
    paths."""
    t = INTERPRETER_TUNING
    assert set(t.tiles.values()) == {(128, 256, 4)} and set(t.tiles_per_program.values()) == {2}
    assert t.transpose_cols is False and t.align_tile == (128, 16, 4)
    assert t.sliced_sources == ("dense",) and t.align_minima == (128, 8)


def test_tuning_is_immutable_and_hashable():
    t = KernelTuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.transpose_cols = False
    with pytest.raises(TypeError):
        t.tiles["rows"] = (16, 128, 4)
    assert hash(t) == hash(KernelTuning()) and t != KernelTuning(transpose_cols=False)


def test_partial_tables_keep_the_other_defaults():
    t = KernelTuning(tiles={"rows": (16, 128, 4)}, tiles_per_program={"rows": 1})
    assert t.tiles["rows"] == (16, 128, 4) and t.tiles["rows_eden"] == (4, 128, 1)
    assert t.tiles_per_program["rows"] == 1 and t.tiles_per_program["cols_eden"] == 4


@pytest.mark.parametrize("changes, match", [
    (dict(tiles={"diagonal": (8, 128, 1)}), "unknown layouts \\['diagonal'\\]"),
    (dict(tiles={"rows": (12, 128, 4)}), "powers of two"),
    (dict(tiles={"rows": (8, 136, 4)}), "powers of two"),
    (dict(tiles={"rows": (8, 128)}), "three positive integers"),
    (dict(tiles={"cols": (8, 64, 4)}), "BM >= 16"),
    (dict(tiles={"cols_eden": (1, 128, 1)}), "BM >= 2"),
    (dict(tiles_per_program={"rows": 0}), "positive integer"),
    (dict(tiles_per_program={"rows": "4"}), "positive integer"),
    (dict(sliced_sources=("dense", "sparse")), "unknown source kinds \\['sparse'\\]"),
    (dict(align_minima=(128,)), "programs, warps"),
])
def test_bad_values_are_refused(changes, match):
    """Settings the kernels cannot run are refused with the reason."""
    with pytest.raises(ValueError, match=match):
        KernelTuning(**changes)


def test_tuning_from_mapping():
    """A config section: tables replace layout by layout, lists stand for tuples, the base is
    the default tuning."""
    t = tuning_from_mapping({"tiles": {"rows": [16, 128, 4]}, "tiles_per_program": {"rows": 1},
                             "transpose_cols": False, "sliced_sources": ["dense", "packed"]},
                            GPU_TUNING)
    assert t.tiles["rows"] == (16, 128, 4) and t.tiles["rows_eden"] == (4, 128, 1)
    assert t.tiles_per_program["rows"] == 1 and not t.transpose_cols
    assert t.sliced_sources == ("dense", "packed")
    assert tuning_from_mapping({}) == tuning_mod.default_tuning()
    base = KernelTuning(tiles={"rows_eden": (8, 128, 1)})
    assert tuning_from_mapping({"tiles": {"rows": [16, 128, 4]}}, base).tiles["rows_eden"] == (8, 128, 1)


def test_tuning_from_mapping_names_unknown_keys():
    with pytest.raises(ValueError) as e:
        tuning_from_mapping({"tile": {"rows": [16, 128, 4]}, "transpose_cols": True})
    msg = str(e.value)
    assert "['tile']" in msg and all(k in msg for k in FIELDS)
    assert "_hash" not in FIELDS
    with pytest.raises(ValueError, match="expected a mapping of layouts"):
        tuning_from_mapping({"tiles": [8, 128, 2]})
    with pytest.raises(ValueError, match="list of source kinds"):
        tuning_from_mapping({"sliced_sources": "dense"})


def test_set_from_code_decides_the_tiles(monkeypatch):
    """set_tuning / use_tuning change the tiles, tiles per program and column path of the next
    launches, and None / the end of the block restore the previous tuning."""
    monkeypatch.setattr(tuning_mod, "_current", None)
    default = get_tuning()
    plan = ops.plan_quantize(1024, 4096, ops.SRC_DENSE, False, 0, "rtn", True, 1, False, True,
                             True, False, False, default)
    custom = tuning_from_mapping({"tiles": {layout: [16, 128, 4] for layout in LAYOUTS},
                                  "tiles_per_program": {layout: 1 for layout in LAYOUTS},
                                  "transpose_cols": False})
    with use_tuning(custom):
        assert get_tuning() is custom
        assert ops._config("rows") == (16, 128, 4) and ops._tiles_per_program("rows") == 1
        assert not ops._transposes_first(ops.SRC_PACKED, True, True, "ms_eden", get_tuning())
        other = ops.plan_quantize(1024, 4096, ops.SRC_DENSE, False, 0, "rtn", True, 1, False,
                                  True, True, False, False, get_tuning())
    assert get_tuning() is default
    assert other.grid == (64, 32) and other.num_warps == 4 and other.constexprs["BM"] == 16
    if default == GPU_TUNING:
        assert plan.grid == (1024,) and plan.num_warps == 2 and plan.constexprs["BM"] == 8
    set_tuning(custom)
    assert ops._config("rows_eden", rot=256) == (16, 256, 4)
    set_tuning(None)
    assert get_tuning() is default
    with pytest.raises(TypeError):
        set_tuning({"tiles": {}})


def test_plan_of_posthoc_eden():
    """The plan of post hoc MS-EDEN rows on the GPU defaults: 4×128 one-warp tiles, four per
    program, shared draws, and an align pass of one program per 128 first-pass programs."""
    p = ops.plan_quantize(16384, 4096, ops.SRC_DENSE, False, 128, "ms_eden", False, 1, False,
                          True, False, True, False, GPU_TUNING)
    assert p.grid == (16384 * 32 // 4 // 4,) and p.num_warps == 1 and p.tiles == 4
    assert p.constexprs["SHARED_U"] and not p.constexprs["PREFETCH"] and p.constexprs["BM"] == 4
    assert p.align is not None and p.align.tiles == p.n_prog // 128 and not p.align.strided
    assert p.align.num_warps == 8 and p.align.constexprs["V"] == 128


def test_the_trainer_config_sets_the_tuning(compose_train) -> None:
    """``kernels:`` of configs/train.yaml is a mapping that tuning_from_mapping takes as it is."""
    assert compose_train([]).kernels == {}
    cfg = compose_train(["+kernels.tiles.rows=[16,128,4]", "+kernels.transpose_cols=false"])
    tuning = tuning_from_mapping(cfg.kernels)
    assert tuning.tiles["rows"] == (16, 128, 4) and tuning.transpose_cols is False
    with pytest.raises(ValueError, match="unknown kernel tuning keys"):
        tuning_from_mapping(compose_train(["+kernels.tile=1"]).kernels)
