"""A solver is one module: a file outside the package, registered lazily as ``module:function``,
brings its own options dataclass (with its checks), trains on views, and is found by its
protocol, the probe config and ``featcache probe``'s flags without any other file edited."""

from __future__ import annotations

import sys
import textwrap

import pytest

from featcache.core import protocols
from featcache.errors import ConfigError, ProbeError
from featcache.probes.config import ProbeConfig
from featcache.probes.solvers import SOLVERS, get_solver, register_solver

TOY = """
from dataclasses import dataclass, replace

from featcache.core.configs import Interval, check_fields, flag
from featcache.core.protocols import get_protocol, register_protocol
from featcache.probes.solver_registry import FitOutcome, ProbeConfigError, register_solver


@dataclass(frozen=True)
class ToyOptions:
    rounds: int | None = flag(None, "toy-solver: boosting rounds (default: 7)", type=int, check=Interval(int, 1))
    shrink: float = flag(0.5, "toy-solver: shrinkage", type=float, check=Interval(float, 0, 1))

    def __post_init__(self):
        check_fields(self)
        if self.rounds is not None and self.rounds > 100:
            raise ProbeConfigError(f"toy-solver takes at most 100 rounds (got {self.rounds})")

    def resolve(self, proto):
        return self if self.rounds is not None else replace(self, rounds=7)


@register_solver("toy-solver", options=ToyOptions, views=True)
def fit_toy(req):
    return FitOutcome(lambda X: X, None, dict(req.opts), True, 0.0)


@register_protocol("toy-proto")
def _toy(arg=None):
    return replace(get_protocol("full"), spec="toy-proto", name="toy-proto", solver="toy-solver")
"""


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "toy_solver_mod.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    with SOLVERS.restored(), protocols.PROTOCOLS["probe"].restored():
        register_solver("toy-solver", "toy_solver_mod:fit_toy")  # lazily: nothing imported yet
        yield
    sys.modules.pop("toy_solver_mod", None)


def test_a_solver_in_one_module_is_found_lazily_with_its_options_and_views(toy_module):
    assert "toy_solver_mod" not in sys.modules
    assert "toy-solver" in SOLVERS
    assert not SOLVERS.entry("toy-solver").loaded
    solver = get_solver("toy-solver")  # imports the module; the decorator made the Solver
    assert "toy_solver_mod" in sys.modules
    assert solver.name == "toy-solver"
    assert solver.views
    assert protocols.get_protocol("toy-proto").solver == "toy-solver"

    cfg = ProbeConfig("c.zarr", ("b",), "d", "toy-proto", shrink=0.25, views=2)
    assert cfg.solver is solver
    assert type(cfg.options).__name__ == "ToyOptions"
    assert (cfg.rounds, cfg.shrink) == (None, 0.25)
    proto, res = cfg.resolve()
    assert res.rounds == 7  # its own resolve filled in the default
    assert {"rounds": 7, "shrink": 0.25, "views": 2}.items() <= res.run_options(proto).items()
    from featcache.probes.views import check_view_solver

    check_view_solver(res.solver, proto, res.views)  # it trains on views: no refusal

    with pytest.raises(ConfigError, match="--rounds 0 is invalid"):
        ProbeConfig("c.zarr", ("b",), "d", "toy-proto", rounds=0)
    with pytest.raises(ProbeError, match="at most 100 rounds"):
        ProbeConfig("c.zarr", ("b",), "d", "toy-proto", rounds=101)
    with pytest.raises(ConfigError, match="--shrink 2"):  # checked even where another solver runs
        ProbeConfig("c.zarr", ("b",), "d", "full", shrink=2.0)
    assert ProbeConfig("c.zarr", ("b",), "d", "full", shrink=0.1).options == ProbeConfig("c.zarr", ("b",), "d").options


def test_featcache_probe_takes_the_new_solvers_flags(toy_module):
    from featcache.cli import build_parser
    from featcache.probes.cli import config_from_args

    argv = ["probe", "--cache", "c.zarr", "--backbone", "b", "--dataset", "d", "--results", "r.parquet"]
    args = build_parser().parse_args([*argv, "--protocol", "toy-proto", "--rounds", "3", "--views", "2"])
    cfg = config_from_args(args)
    assert (cfg.rounds, cfg.shrink, cfg.views) == (3, 0.5, 2)
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["probe"]
    assert "boosting rounds" in sub.format_help()


def test_a_config_pickles_and_finds_its_solver_again():
    import copy
    import pickle

    cfg = ProbeConfig("c.zarr", ("b",), "d", "dinov2-linear", batch_size=8)
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert again == cfg
        assert again.solver is cfg.solver
        assert again.batch_size == 8


def test_views_are_refused_for_a_solver_that_does_not_train_on_them():
    from featcache.probes.views import check_view_solver

    cfg = ProbeConfig("c.zarr", ("b",), "d", "salman", views=2)
    with pytest.raises(ProbeError, match=r"does not train on augmented views.*'lbfgs'"):
        check_view_solver(cfg.solver, cfg.resolve()[0], cfg.views)
    assert get_solver("lbfgs").views
    assert get_solver("lars").views
    assert get_solver("dinov2-linear").views
    assert not get_solver("sgd").views
    assert not get_solver("elevater").views


def test_every_solver_option_flag_round_trips():
    """Each registered solver's option flags (not ProbeConfig fields) reach its options."""
    from featcache.cli import build_parser
    from featcache.probes.cli import config_from_args

    base = ["probe", "--cache", "c.zarr", "--backbone", "b", "--dataset", "d", "--results", "r.parquet"]
    cases = {
        "full": (
            ["--backend", "torch", "--max-iter", "50", "--tol", "0.01", "--sweep", "halving", "--no-standardize"],
            {"backend": "torch", "max_iter": 50, "tol": 0.01, "sweep": "halving", "standardize": False},
        ),
        "salman": (["--epochs", "7"], {"sgd_epochs": 7}),
        "dinov2-linear": (
            ["--epochs", "2", "--batch-size", "16", "--epoch-length", "5"],
            {"sgd_epochs": 2, "batch_size": 16, "epoch_length": 5},
        ),
        "elevater-full": (
            ["--search-epochs", "2", "--final-epochs", "3", "--final-epoch", "best-test"],
            {"search_epochs": 2, "final_epochs": 3, "final_epoch": "best-test"},
        ),
    }
    for proto, (flags, want) in cases.items():
        cfg = config_from_args(build_parser().parse_args([*base, "--protocol", proto, *flags]))
        assert {k: getattr(cfg, k) for k in want} == want, proto
        assert cfg == ProbeConfig("c.zarr", ("b",), "d", proto, results_path="r.parquet", **want), proto
