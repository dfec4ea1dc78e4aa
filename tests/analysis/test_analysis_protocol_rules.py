"""The analysis reads a protocol's rules from the protocol (seed reduction, task label), never from
its name, and negates lower-is-better metrics in one function."""

from __future__ import annotations

import dataclasses

import polars as pl

from featcache.analysis.tables import negate_lower_is_better, protocol_label, seed_rule
from featcache.core import protocols as P


def test_labels_and_seed_rules_come_from_the_protocols():
    assert [protocol_label(s) for s in ("full", "zeroshot", "fewshot:5", "knn", "", None)] == [
        "",
        "zero-shot",
        "fewshot:5",
        "knn",
        "",
        "",
    ]
    rules = {s: seed_rule(s) for s in ("elevater-fewshot:5", "elevater-full", "vtab1k", "knn", None)}
    assert rules == {
        "elevater-fewshot:5": "mean",
        "elevater-full": "mean",
        "vtab1k": "median",
        "knn": "median",
        None: "median",
    }
    assert seed_rule("elevater-full", "median") == "median"


def test_a_new_protocol_sets_its_rules_by_fields():
    full = P.get_protocol("full")
    with P.PROTOCOLS["probe"].restored():
        P.register_protocol("t55mean")(
            lambda arg=None: dataclasses.replace(
                full, spec="t55mean", name="t55mean", seed_rule="mean", table_label="T55"
            )
        )
        assert (seed_rule("t55mean"), protocol_label("t55mean")) == ("mean", "T55")
    assert (seed_rule("t55mean"), protocol_label("t55mean")) == ("median", "t55mean")  # gone again


def test_lower_is_better_metrics_are_negated_once():
    df = pl.DataFrame({"metric": ["top1", "nll", "ece"], "value": [0.9, 0.3, 0.1]})
    assert negate_lower_is_better(df, "top1", "mrr")["value"].to_list() == [0.9, 0.3, 0.1]
    assert negate_lower_is_better(df, "nll", "mrr")["value"].to_list() == [0.9, -0.3, -0.1]
