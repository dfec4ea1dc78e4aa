"""The protocols' hyper-parameter grids are the same floats on every CPU: they enter run ids and
the fits, and numpy's power kernels differ in the last bit between CPUs (its AVX-512 path is not
correctly rounded), so ``log_grid`` computes them in decimal. Checked against an independent
reference: ``10 ** (a + k/d)`` built from an exact integer power and a 60-digit root."""

from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from featcache.core.protocols import C_GRID, DINOV2_C_GRID, ElevaterGrid, log_grid


def _reference(lo: int, hi: int, n: int) -> tuple[float, ...]:
    """10 ** e for e = lo + i (hi - lo) / (n - 1), each rounded once from 60 digits."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 60
        for i in range(n):
            e = Fraction(lo) + Fraction(i * (hi - lo), n - 1)
            whole, frac = divmod(e, 1)  # 10 ** e = 10 ** whole * (10 ** num) ** (1 / den)
            root = (Decimal(10) ** frac.numerator) ** (Decimal(1) / frac.denominator) if frac else Decimal(1)
            out.append(float(Decimal(10) ** int(whole) * root))
    return tuple(out)


@pytest.mark.parametrize(("grid", "args"), [(C_GRID, (-6, 5, 45))])
def test_the_c_grid_is_the_correctly_rounded_logspace(grid, args):
    assert grid == _reference(*args)
    assert len(grid) == 45
    assert (grid[0], grid[24], grid[-1]) == (1e-6, 1.0, 1e5)


def test_the_elevater_grids_are_the_correctly_rounded_logspace():
    g = ElevaterGrid()
    assert g.lrs == _reference(-6, -1, 6)
    assert g.wds == _reference(-6, 6, 97)


@given(st.integers(-8, 0), st.integers(1, 8), st.integers(0, 3))
def test_log_grid_is_numpy_logspace_to_an_ulp_where_the_exponents_are_exact(lo, span, j):
    """With steps of span / (span * 2**j) the exponents are floats exactly, so numpy's logspace can
    only differ by its power kernel's rounding (none here; up to a few ulp on AVX-512)."""
    n = span * 2**j + 1
    grid = np.array(log_grid(lo, lo + span, n))
    np.testing.assert_array_max_ulp(grid, np.logspace(lo, lo + span, n), maxulp=4)
    assert (grid[0], grid[-1]) == (float(f"1e{lo}"), float(f"1e{lo + span}"))  # the decimal literals


def test_the_dinov2_grid_is_float32_and_near_its_torch_definition():
    torch = pytest.importorskip("torch")
    ref = (10 ** torch.linspace(-6, 5, 45)).tolist()  # dinov2/eval/log_regression.py
    assert all(float(np.float32(c)) == c for c in DINOV2_C_GRID)  # float32 values
    np.testing.assert_array_max_ulp(np.float32(DINOV2_C_GRID), np.float32(ref), maxulp=2)
