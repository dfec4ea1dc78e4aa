"""Round trips of every writable result format on generated results tables (Hypothesis): what
a format takes comes back with the same run-level columns and values (MTEB's rounded to 6
places, as mteb's ``to_disk`` writes them); what it has no place for is named, never written."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featcache.core.results import append_results, read_results
from featcache.errors import ResultsError
from featcache.interop import ExportConfig, export_results, read_external
from featcache.interop.cli import EXPORT_FORMATS
from featcache.interop.runs import RUN_COLUMNS

KEPT = [c for c in RUN_COLUMNS if c not in ("run_id", "hparams")]
BACKBONES = ["tf_efficientnet_lite0", "open_clip:ViT-B-32", "hf:facebook/dinov2-small", "random:0"]
METRICS = ["top1", "top5", "mean_per_class", "nll", "ece"]


@st.composite
def runs(draw) -> list[dict]:
    rows = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["probe", "knn", "finetune", "retrieval"]))
        run = {
            "run_id": f"{i:016x}",
            "kind": kind,
            "backbone": draw(st.sampled_from(BACKBONES)),
            "dataset": draw(st.sampled_from(["cifar10", "digits", "Fashion-MNIST"])),
            "protocol": draw(st.sampled_from(["full", "fewshot:5", "zeroshot", "vtab1k"])),
            "train_split": "train",
            "eval_split": draw(st.sampled_from(["test", "val"])),
            "shots": draw(st.sampled_from([-1, 5])),
            "seed": i,  # distinct runs of one cell differ by seed, as featcache's own
            "n_eval": draw(st.integers(2, 5000)),
            "hparams": {"C": draw(st.floats(1e-6, 1e5)), "head_init": None, "note": "x"},
            "converged": draw(st.booleans()),
            "fit_seconds": draw(st.floats(0, 100)),
            "store_fingerprint": draw(st.sampled_from(["2ab784e0d0132515", "0f0f0f0f0f0f0f0f"])),
            "created_at": f"2026-12-0{draw(st.integers(1, 9))}T10:00:0{i}+00:00",
        }
        metrics = draw(st.lists(st.sampled_from(METRICS), min_size=1, max_size=5, unique=True))
        for m in metrics:
            rows.append({**run, "metric": m, "value": draw(st.floats(0, 1, allow_subnormal=False))})
    return rows


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=runs())
def test_a_format_gives_back_what_it_takes(fmt, rows):
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "r.parquet"
        own = append_results(table, rows)
        cfg = ExportConfig(str(table), str(Path(tmp) / "out"), fmt)
        if fmt == "clip_benchmark" and not (own["kind"] == "probe").any():  # nothing it has a task for
            with pytest.raises(ResultsError, match=r"no run of .* fits clip_benchmark: run .* has no task"):
                export_results(cfg)
            return
        rep = export_results(cfg)
        skipped = {line.split()[1] for line in rep.skipped}
        name, got, problems = read_external(Path(tmp) / "out", "auto")
    assert (name, problems) == (fmt, ())
    assert rep.runs + len(skipped) == own["run_id"].n_unique()
    want = own.filter(~own["run_id"].is_in(list(skipped)))
    assert got.height == want.height
    back = {(json.loads(r["hparams"])["external"]["run_id"], r["metric"]): r for r in got.iter_rows(named=True)}
    for r in want.iter_rows(named=True):
        b = back[(r["run_id"], r["metric"])]
        assert {c: b[c] for c in KEPT} == {c: r[c] for c in KEPT}
        assert b["value"] == pytest.approx(r["value"], abs=5e-7 if fmt == "mteb" else 0.0, rel=0)
        hp = json.loads(b["hparams"])
        del hp["external"]
        assert hp == json.loads(r["hparams"])


def test_clip_benchmark_names_each_run_it_leaves_out(tmp_path):
    row = {"run_id": "r1", "kind": "retrieval", "backbone": "b", "dataset": "d", "metric": "map", "value": 0.5}
    table = tmp_path / "r.parquet"
    append_results(table, [row, {**row, "run_id": "r2", "kind": "probe", "metric": "top1"}])
    rep = export_results(ExportConfig(str(table), str(tmp_path / "out"), "clip_benchmark"))
    assert rep.skipped == ("run r1 (retrieval): CLIP_benchmark has no task for image-only retrieval rows",)
    assert [p.name for p in rep.files] == ["d_unknown_b_en_linear_probe.json"]
    assert read_results(table).height == 2


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_backbones_spelled_alike_in_file_names_are_refused_before_writing(fmt, tmp_path):
    """`lite:a` and `lite-a` get one folder / model name in every format: one would overwrite the
    other's file, so the export is refused in one line naming both, and nothing is written."""
    base = {
        "kind": "probe", "dataset": "digits", "protocol": "full", "train_split": "train", "eval_split": "test",
        "shots": -1, "seed": 0, "n_eval": 100, "hparams": {}, "metric": "top1", "value": 0.5,
        "store_fingerprint": "2ab784e0d0132515", "created_at": "2026-12-07T10:00:00+00:00",
    }  # fmt: skip
    table = tmp_path / "r.parquet"
    append_results(
        table, [{**base, "run_id": "a" * 16, "backbone": "lite:a"}, {**base, "run_id": "b" * 16, "backbone": "lite-a"}]
    )
    with pytest.raises(ResultsError, match=r"^backbones lite-a and lite:a get the same name in .*separate --out"):
        export_results(ExportConfig(str(table), str(tmp_path / "out"), fmt))
    assert not (tmp_path / "out").exists()
