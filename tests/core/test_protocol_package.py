"""core/protocols as a package: a protocol and a split plan registered from a module of their own
(written here into a temporary folder) are found by the lookups, plan, and show in ``featcache
probe --help`` with no other file edited; the split-plan registry carries the rules the split
names used to decide; a fixed protocol names itself once and takes no argument."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.core import protocols as P
from featcache.errors import ProtocolError

PLUGIN = textwrap.dedent(
    '''
    """A protocol and its split plan, one file outside the package."""
    import numpy as np

    from featcache.core.protocols import CGrid, SplitPlan, register_fixed_protocol, register_split_plan


    @register_split_plan("t55evens", val_split=False, note="even rows train, odd rows select")
    def evens(p, y, seed, n_val, val_source, train_name, val_name, **_):
        idx = np.arange(y.size)
        return SplitPlan(idx[::2], idx[1::2], idx, f"{train_name}[evens]", {"val": "odd rows"})


    register_fixed_protocol(
        "t55proto", note="a plug-in protocol", split="t55evens", solver="lbfgs", grid=CGrid(), seed_rule="mean"
    )
    '''
)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plug-in module imported from ``tmp_path``; every registry as it was afterwards."""
    (tmp_path / "t55_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with P.PROTOCOLS["probe"].restored(), P.SPLIT_PLANS.restored():
        yield importlib.import_module("t55_plugin")
    sys.modules.pop("t55_plugin", None)
    assert "t55proto" not in P.list_protocols()
    assert "t55evens" not in P.list_split_plans()


def _probe_help() -> str:
    from featcache.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    return " ".join(sub["probe"].format_help().split())


def test_a_protocol_and_a_split_plan_from_their_own_module_are_found(plugin):
    p = P.get_protocol("t55proto")
    assert (p.spec, p.name, p.stage, p.split, p.seed_rule) == ("t55proto", "t55proto", "probe", "t55evens", "mean")
    assert "t55evens" in P.list_split_plans()
    assert "t55proto" in P.list_protocols()
    y = load_digits().target
    plan = p.plan(y, 0, n_val=50)
    assert np.array_equal(plan.train, np.arange(0, y.size, 2))
    assert np.array_equal(plan.val, np.arange(1, y.size, 2))
    assert plan.train_split == "train[evens]"
    assert not p.uses_val_split("official-val")
    assert not p.auto_official_val
    assert "t55proto (a plug-in protocol)" in _probe_help()


def test_the_probe_stage_takes_the_plugin_protocol(plugin):
    from featcache.probes import ProbeConfig

    proto, cfg = ProbeConfig("c", ("b",), "d", "t55proto").resolve()
    assert (proto.split, cfg.seeds, len(cfg.Cs)) == ("t55evens", (0,), 45)
    assert len(cfg.run_id(proto, "b", 0, "test", "fp")) == 16


def test_split_plans_are_one_registry_with_the_rules_the_names_gave():
    assert P.list_split_plans() == [
        "full",
        "fewshot",
        "subset",
        "elevater-full",
        "elevater-fewshot",
        "vtab1k",
        "none",
        "vtab1k-stratified",
        "dinov2",
        "train",
        "no-refit",
    ]
    # what Protocol.uses_val_split decided from the split names before the registry carried it
    never = {"fewshot", "none", "elevater-full", "elevater-fewshot", "train"}
    for name in P.list_split_plans():
        rules = P.split_rules(name)
        for vs in ("split-800-200", "official-val"):
            before = name not in never and not (name.startswith("vtab1k") and vs == "split-800-200")
            assert (rules.val_split and not (rules.val_source and vs == "split-800-200")) == before, (name, vs)
        assert rules.auto_official_val == (name == "vtab1k"), name
    with pytest.raises(ProtocolError, match="already registered"):
        P.register_split_plan("full")(lambda *a, **k: None)


def test_a_protocol_naming_an_unknown_split_plan_is_refused():
    with pytest.raises(ProtocolError, match=r"unknown split plan 'fulll'; did you mean 'full'"):
        P.Protocol(spec="x", name="x", stage="probe", split="fulll", solver="lbfgs", grid=P.CGrid())
    with pytest.raises(ProtocolError, match="seed_rule"):
        P.Protocol(spec="x", name="x", stage="probe", split="full", solver="lbfgs", grid=P.CGrid(), seed_rule="max")


def test_a_fixed_protocol_names_itself_once_and_takes_no_argument():
    for stage in P.STAGES:
        for name in P.list_protocols(stage):
            if P.PROTOCOLS[stage].entry(name).usage == name:  # not parametrised
                p = P.get_protocol(name, stage)
                assert (p.spec, p.name, p.stage) == (name, name, stage)
                with pytest.raises(ProtocolError, match=f"protocol '{name}' takes no argument"):
                    P.get_protocol(f"{name}:1", stage)


def test_the_analysis_rules_are_protocol_fields():
    assert {n: P.get_protocol(n).seed_rule for n in ("elevater-full", "elevater-fewshot:5", "vtab1k", "full")} == {
        "elevater-full": "mean",
        "elevater-fewshot:5": "mean",
        "vtab1k": "median",
        "full": "median",
    }
    assert (P.get_protocol("full").table_label, P.get_protocol("zeroshot").table_label) == ("", "zero-shot")
    assert P.get_protocol("fewshot:5").table_label is None
