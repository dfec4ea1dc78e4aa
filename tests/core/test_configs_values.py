"""Issue 60: every numeric flag built by ``configs.add_arguments`` refuses NaN, infinity and
overflow at the boundary, in one line with the field's valid range."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from featcache.core import configs
from featcache.core.configs import Interval, flag, float_list


@dataclass(frozen=True)
class _Cfg:
    width: float = flag(1.0, "a width", type=float, check=Interval(float, 0, 1000, open_lo=True))
    count: int = flag(1, "a count", type=int, check=Interval(int, 1, 10))
    rates: tuple = flag((0.1,), "rates", type=float_list)
    loose: float = flag(0.5, "no check", type=float)


def _parse(*words: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    configs.add_arguments(p, _Cfg)
    return p.parse_args(list(words))


@pytest.mark.parametrize(
    ("words", "want"),
    [
        (("--count", "1e400"), "'1e400' is invalid: must be an integer >= 1 and at most 10"),
        (("--rates", "0.1,inf"), "'0.1,inf' is invalid: must be a finite number"),
        (("--loose=-inf",), "'-inf' is invalid: must be a finite number"),
    ],
)
def test_non_finite_numbers_are_refused_with_the_range(words, want):
    with pytest.raises(argparse.ArgumentError, match=want):
        _parse(*words)


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-inf"])
def test_an_interval_float_refuses_non_finite_values_with_its_range(value):
    from featcache.errors import ConfigError

    ns = _parse(f"--width={value}")
    with pytest.raises(ConfigError, match=r"--width .* is invalid: must be a finite number > 0 and at most 1000$"):
        configs.check_fields(_Cfg(width=ns.width))


def test_finite_numbers_pass_and_the_open_bound_is_checked():
    assert _parse("--width", "2.5", "--count", "3", "--rates", "0.1,0.2").width == 2.5
    assert Interval(float, 0, open_lo=True)(0.0) == "must be a finite number > 0"
    assert Interval(float, 0)(0.0) is None
    assert Interval(float, 0, 5, open_lo=True).wanted() == "must be a finite number > 0 and at most 5"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--rbf-threshold", "inf"], "--rbf-threshold inf is invalid: must be a finite number > 0 and at most 1000"),
        (["--rbf-sigma", "inf"], "--rbf-sigma inf is invalid: must be a finite number > 0 and at most 1e+150"),
        (["--rbf-threshold", "1e300"], "--rbf-threshold 1e+300 is invalid: must be at most 1000"),
        (["--rbf-sigma", "0"], "--rbf-sigma 0.0 is invalid: must be a finite number > 0"),
        (["--max-memory", "1e400"], "--max-memory '1e400' is not a finite size"),
    ],
)
def test_similarity_bandwidths_and_bound_are_one_line(argv, want, capsys):
    """``--rbf-threshold inf`` / ``--rbf-sigma inf`` wrote NaN rows (exit 0); 1e300 overflowed."""
    from featcache.cli import main

    try:
        rc = main(["similarity", "--cache", "c", "--dataset", "d", "--all", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc in (1, 2)
    assert want in err.strip().splitlines()[-1]
    assert "Traceback" not in err
