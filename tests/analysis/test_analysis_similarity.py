"""The similarity heatmaps' titles come from the results table: each row records its measure's
report text (hparams ``measure_text``), so the analysis imports no stage and a new measure needs
nothing here; a table written before rows recorded it is titled with the metric name."""

from __future__ import annotations

import json

import polars as pl

from featcache.analysis.similarity import similarity_matrices


def _rows(hparams: list[dict]) -> pl.DataFrame:
    n = len(hparams)
    return pl.DataFrame(
        {
            "kind": ["similarity"] * n,
            "dataset": ["digits"] * n,
            "eval_split": ["test"] * n,
            "metric": ["cka_linear", "my_measure"][:n],
            "backbone": ["a"] * n,
            "protocol": ["vs:b"] * n,
            "value": [0.5, 0.25][:n],
            "created_at": ["2024-01-01T00:00:00"] * n,
            "hparams": [json.dumps(h) for h in hparams],
        }
    )


def test_the_title_is_the_recorded_measure_text():
    frame = _rows([{"measure_text": "linear CKA"}, {"measure_text": "my measure (plug-in)"}])
    titles = [m.title for m in similarity_matrices(frame)]
    assert titles == ["linear CKA on digits/test", "my measure (plug-in) on digits/test"]


def test_an_old_table_without_the_text_is_titled_with_the_metric():
    (m,) = similarity_matrices(_rows([{"backbone_a": "a", "backbone_b": "b"}]))
    assert m.title == "cka_linear on digits/test"
    assert m.values[0, 1] == m.values[1, 0] == 0.5
