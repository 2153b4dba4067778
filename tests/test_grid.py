"""The default subset of the GPU kernel grids (conftest.py ``grid``) still covers every combination: runs on CPU.

Every test parametrized with ``grid`` keeps, without ``-m full``, every combination of its categorical parameters
(tile, dtype, mask, head_dim, heads, split count, decode q_len) and every length (q_len/kv_len pair, kv_len) at least
once, and leaves out the rest of the cross product (marked ``full``).

    pytest tests/test_grid.py -q
"""

from __future__ import annotations

import itertools

import pytest
import test_backward_gpu
import test_kernel_gpu
from conftest import FULL, grid

LENGTH_NAMES = {"sq", "sk"}
GRID_TESTS = [(test_kernel_gpu, "test_kernel_grid", 2), (test_kernel_gpu, "test_forced_tiles", 1),
              (test_kernel_gpu, "test_decode_kernel_grid", 2), (test_backward_gpu, "test_backward_grid", 2),
              (test_backward_gpu, "test_backward_forced_splits", 1)]


def _cases(fn):
    (mark,) = [m for m in fn.pytestmark if m.name == "parametrize"]
    names = [n.strip() for n in mark.args[0].split(",")]
    cases = [(dict(zip(names, p.values, strict=True)), any(m.name == FULL for m in p.marks)) for p in mark.args[1]]
    return names, cases


@pytest.mark.parametrize("module,name,per_combo", GRID_TESTS, ids=[n for _, n, _ in GRID_TESTS])
def test_default_subset_covers_every_combination_and_length(module, name, per_combo):
    names, cases = _cases(getattr(module, name))
    axes = [n for n in names if n not in LENGTH_NAMES]
    lengths = [n for n in names if n in LENGTH_NAMES]
    key = lambda case, which: tuple(case[n] for n in which)  # noqa: E731
    every_combo = {key(c, axes) for c, _ in cases}
    assert len(cases) == len(every_combo) * len({key(c, lengths) for c, _ in cases}), "not a full cross product"
    default = [c for c, full in cases if not full]
    assert len(default) < len(cases) / 2
    per = {combo: 0 for combo in every_combo}
    for c in default:
        per[key(c, axes)] += 1
    assert min(per.values()) >= per_combo, f"combinations with too few lengths: {per}"
    assert {key(c, lengths) for c in default} == {key(c, lengths) for c, _ in cases}, "a length never runs"


def test_grid_marks_the_rest_full_and_rotates_the_lengths():
    params = grid([["a", "b", "c"]], [(1, 2), (3, 4), (5, 6)], per_combo=1)
    kept = [p.values for p in params if not p.marks]
    assert kept == [("a", 1, 2), ("b", 5, 6), ("c", 3, 4)]
    assert all([m.name for m in p.marks] == [FULL] for p in params if p.values not in kept)
    assert [p.id for p in params][:2] == ["a-1-2", "a-3-4"]
    assert len(grid([[0, 1], [True]], list(range(6)), per_combo=2)) == 12
    assert sum(not p.marks for p in grid([[0, 1], [True]], list(range(6)), per_combo=2)) == 4
    assert list(itertools.chain.from_iterable(p.values for p in grid([[7]], [9]))) == [7, 9]
