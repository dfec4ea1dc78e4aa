"""The report cannot mislead (issue 60, deliverable 8 and the report half of 7): a random-init
backbone is named the baseline wherever it is ranked and is never the advice; the headline, the
ranking table and the plot under them use one interval and the header counts the settings the
ranking counts; the headline points to per-setting intervals only where they exist; throughput
is shown with the threads and load it was measured at; numbers never wrap mid-value (a headless
Chromium at 1,400 px)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import polars as pl
import pytest

from featcache.analysis import plots
from featcache.analysis import rankings as R
from featcache.analysis import report as REP
from featcache.analysis.report import write_report

LITE0, RANDOM = "tf_efficientnet_lite0", "tf_efficientnet_lite0@random0"
BASELINE_SUFFIX = " (random baseline)"  # rankings.BASELINE_SUFFIX, spelled out: the words the reader sees


def _rows(scores: dict[str, list[float]], *, seeds=(0,), knn_ks=(), n_eval: int = 300) -> pl.DataFrame:
    """One probe setting per dataset (``scores[b][i]`` on dataset ``ds{i}``), kNN at ``knn_ks``
    on ds0, every seed the same score plus a small per-seed offset."""
    rows = []
    for b, vals in scores.items():
        for seed in seeds:
            common = {"backbone": b, "metric": "top1", "n_eval": n_eval, "seed": seed, "hparams": "{}"}
            for i, v in enumerate(vals):
                rows.append(
                    {**common, "dataset": f"ds{i}", "kind": "probe", "protocol": "full", "value": v + 0.001 * seed}
                )
            for k in knn_ks:
                rows.append(
                    {
                        **common,
                        "dataset": "ds0",
                        "kind": "knn",
                        "protocol": f"knn-k{k}",
                        "value": vals[0] - 0.01 * k / 10,
                    }
                )
    return pl.DataFrame(rows)


def _report(tmp_path, rows, catalog=None, **kw) -> str:
    return write_report(tmp_path / "r.html", rows, catalog, rank_kwargs={"n_boot": 100, **kw}).read_text()


def _section(text: str, sid: str) -> str:
    start = text.index(f'<section id="{sid}">')
    return text[start : text.index("</section>", start)]


def _cells(text: str, table_id: str) -> list[str]:
    start = text.index(f'id="{table_id}"')
    body = text[start : text.index("</table>", start)]
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body)]


# ----------------------------------------------------------------------------- the random baseline


def test_a_random_baseline_first_is_never_the_advice(tmp_path, monkeypatch):
    """The README's "Your own images" case: lite0 and lite0@random0 on a small folder, random
    first. The report opened "Use tf_efficientnet_lite0@random0"; it now says no pretrained
    backbone beat the random baseline, and names it the baseline in its tables and plots."""
    seen = {}
    real = plots.zscore_heatmap

    def spy(zscores, path, **kw):
        seen["heatmap"] = zscores["backbone"].to_list()
        return real(zscores, path, **kw)

    monkeypatch.setattr(plots, "zscore_heatmap", spy)
    text = _report(tmp_path, _rows({LITE0: [0.60, 0.55, 0.70], RANDOM: [0.70, 0.62, 0.75]}))
    answer = re.search(r'<p class="answer">(.*?)</p>', text, re.S).group(1)
    assert not answer.startswith(f"Use {RANDOM}")
    assert "Use " not in answer
    assert answer.startswith("No pretrained backbone beat the random baseline: " + RANDOM + BASELINE_SUFFIX)
    assert f"best pretrained backbone {LITE0} is #2" in answer
    named = RANDOM + BASELINE_SUFFIX
    assert named in _cells(text, "overall-table")
    assert named in _cells(text, "top3-table")
    assert named in _cells(text, "bootstrap-table")
    assert named in seen["heatmap"]
    assert RANDOM not in [c for t in ("overall-table", "top3-table") for c in _cells(text, t)]


def test_a_pretrained_first_is_the_advice_and_the_baseline_is_still_named(tmp_path):
    text = _report(tmp_path, _rows({LITE0: [0.80, 0.75, 0.90], RANDOM: [0.70, 0.62, 0.75]}))
    answer = re.search(r'<p class="answer">(.*?)</p>', text, re.S).group(1)
    assert answer.startswith(f"Use {LITE0}: first by mean z-score")
    assert f"runner-up {RANDOM}{BASELINE_SUFFIX}" in answer
    assert RANDOM + BASELINE_SUFFIX in _cells(text, "overall-table")


def test_the_catalog_weights_say_which_backbone_is_random_whatever_its_key():
    """One place decides: the catalog's weights where it names the backbone (a --backbone-name
    hides nothing), else the key extract gives a random init (MODEL@randomSEED)."""
    cat = pl.DataFrame(
        {"backbone": ["mine", "x@random0", LITE0], "weights": ["random:3", "package:efficientnet", "timm"]}
    )
    names = ["mine", "x@random0", LITE0, RANDOM, "vit@random12"]
    assert R.random_baselines(names, cat) == {"mine", RANDOM, "vit@random12"}
    assert R.random_baselines(names) == {"x@random0", RANDOM, "vit@random12"}
    assert R.random_baselines(["a@randomness", "random:0"]) == set()


def test_only_random_baselines_ranked_recommend_nothing(tmp_path):
    rows = _rows({RANDOM: [0.60, 0.55, 0.70], "vit@random1": [0.70, 0.62, 0.75]})
    answer = re.search(r'<p class="answer">(.*?)</p>', _report(tmp_path, rows), re.S).group(1)
    assert answer.startswith("Every ranked backbone is a random-init baseline")
    assert "no pretrained backbone to recommend" in answer


# ----------------------------------------------------------------------------- one interval, one count


def test_the_header_counts_the_settings_the_ranking_counts(tmp_path):
    """The demo's header said 8 settings where the ranking ranked 5 (kNN's k values are one
    setting): the header counts what the ranking counts and says what it pooled."""
    rows = _rows({"a": [0.8, 0.7], "b": [0.7, 0.75], "c": [0.6, 0.5]}, knn_ks=(10, 20, 50))
    text = _report(tmp_path, rows)
    ranked = len([c for c in _cells(text, "weights-table") if re.fullmatch(r"(probe|knn):ds\d( \(knn\))?", c)])
    assert ranked == 3  # probe:ds0, probe:ds1, knn:ds0 (three k values pooled)
    assert "3 backbone(s), 3 setting(s) on 2 dataset(s)" in text
    assert "3 kNN k value(s) pooled into their setting" in text
    assert "over 3 setting(s)" in text


def test_the_plot_under_the_headline_draws_the_headline_interval(tmp_path):
    """The demo's headline said "not separated" above a plot of other (bootstrap-over-settings)
    intervals that barely overlapped: section 1 now shows the headline's paired interval (lead
    column and plot); the bootstrap plot is in section 3, named as not the headline's."""
    rows = _rows({"a": [0.80, 0.71, 0.90], "b": [0.79, 0.70, 0.91], "c": [0.60, 0.50, 0.70]}, n_eval=200)
    text = _report(tmp_path, rows)
    choose, certainty = _section(text, "choose"), _section(text, "certainty")
    interval = re.search(r"the paired 95% interval (\[[-+]\d\.\d\d, [-+]\d\.\d\d\])", choose).group(1)
    lead = [c for c in _cells(choose, "overall-table") if c.endswith("]")]
    assert lead
    assert lead[0].endswith(interval)  # the runner-up's row: the headline's numbers
    assert "The headline&#39;s interval: paired 95% interval" in choose
    assert "bootstrap interval" not in re.sub(r'<p class="note" id="interval-rule">.*?</p>', "", choose, flags=re.S)
    assert "Mean z-score with its 95% bootstrap interval resampling" in certainty
    assert "not the headline's interval" in certainty  # the template's own words (not escaped)


@pytest.mark.parametrize("seeds", [(0,), (0, 1, 2)])
def test_the_headline_points_to_per_setting_intervals_only_where_they_exist(tmp_path, seeds):
    """With 3 backbones the headline sent the reader to per-setting paired intervals that every
    row said did not exist ("none: 1 paired seed(s)")."""
    rows = _rows({"a": [0.80, 0.71, 0.90], "b": [0.79, 0.70, 0.91], "c": [0.60, 0.50, 0.70]}, seeds=seeds)
    answer = re.search(r'<p class="answer">(.*?)</p>', _report(tmp_path, rows), re.S).group(1)
    if len(seeds) == 1:
        assert "each with its own paired interval over seeds" not in answer
        assert "have no interval of their own (every setting has one seed" in answer
    else:
        assert "each with its own paired interval over seeds" in answer


# ----------------------------------------------------------------------------- throughput


def _catalog(ips: dict[str, float], threads: dict[str, int] | None = None, load: dict[str, float] | None = None):
    cat = {
        "backbone": list(ips),
        "dataset": ["ds0"] * len(ips),
        "split": ["test"] * len(ips),
        "kind": ["pooled"] * len(ips),
        "bytes": [2**20] * len(ips),
        "weights": ["timm"] * len(ips),
        "images_per_s": list(ips.values()),
    }
    if threads is not None:
        cat["extract_threads"] = [threads[b] for b in ips]
    if load is not None:
        cat["load_avg"] = [load[b] for b in ips]
    return pl.DataFrame(cat)


def test_throughput_is_shown_with_its_threads_and_load(tmp_path):
    """The issue's 20.5 vs 80.1 img/s for one architecture: 2 threads at load 5 vs 1 thread at
    load 0.4. Each figure shows both and the report says they are not comparable."""
    rows = _rows({"a": [0.8, 0.7], "b": [0.7, 0.75], "c": [0.6, 0.5]})
    cat = _catalog({"a": 20.5, "b": 80.1, "c": 75.0}, {"a": 2, "b": 1, "c": 1}, {"a": 5.2, "b": 0.4, "c": 0.3})
    cost = _section(_report(tmp_path, rows, cat), "cost")
    head = re.findall(r"<th[^>]*>(.*?)</th>", cost[cost.index('id="efficiency-table"') :])
    assert head[1:4] == ["images_per_s", "extract_threads", "load_avg"]
    cells = _cells(cost, "efficiency-table")
    at = cells.index("a")
    assert cells[at + 1 : at + 4] == ["20.5", "2", "5.2"]
    assert (
        "measured at different thread counts (1, 2) and load averages (0.3 to 5.2), so they are not comparable" in cost
    )
    assert "so neither is this correlation" in cost
    same = _catalog({"a": 20.5, "b": 80.1, "c": 75.0}, {"a": 1, "b": 1, "c": 1}, {"a": 0.4, "b": 0.5, "c": 0.3})
    cost = _section(_report(tmp_path, rows, same), "cost")
    assert "Every throughput was measured at 1 thread(s) with a load average of 0.3 to 0.5" in cost
    assert "not comparable" not in cost


def test_throughput_of_an_old_store_says_threads_and_load_were_not_recorded(tmp_path):
    rows = _rows({"a": [0.8, 0.7], "b": [0.7, 0.75], "c": [0.6, 0.5]})
    text = _report(tmp_path, rows, _catalog({"a": 20.5, "b": 80.1, "c": 75.0}))
    cost = _section(text, "cost")
    assert "Threads and machine load were not recorded for these extractions" in cost
    cells = _cells(cost, "efficiency-table")
    assert cells[cells.index("a") + 1 : cells.index("a") + 4] == ["20.5", "not recorded", "not recorded"]
    catalog = _cells(text, "catalog-table")
    assert catalog.count("not recorded") == 2 * 3  # beside each throughput of the store catalog too


def test_a_backbone_without_conditions_among_recorded_ones_is_named():
    cat = _catalog({"a": 20.5, "b": 80.1}, {"a": 1, "b": 1}, {"a": 0.4, "b": None})
    note, comparable = R.throughput_note(cat)
    assert not comparable
    assert "not recorded for b" in note


# ----------------------------------------------------------------------------- numbers never wrap


def test_numeric_text_cells_are_marked_to_never_wrap(tmp_path):
    for v in ("0.7527", "+0.25 [-0.30, +0.79]", "0.81 +/- 0.02", "1e-05", "-1.37"):
        assert REP.is_numeric_text(v), v
    for v in ("tf_efficientnet_lite0", "knn:ds0 (knn-k10)", "True", "", "not recorded"):
        assert not REP.is_numeric_text(v), v
    text = _report(tmp_path, _rows({"a": [0.8, 0.7], "b": [0.7, 0.75], "c": [0.6, 0.5]}))
    assert "td.n{white-space:nowrap" in text
    assert '<td class="n">0.75</td>' in text


#: numeric cells (digits, no words) whose text spans more than one line box
WRAPPED_NUMBERS = """(() => [...document.querySelectorAll('td')].filter(td => {
  const t = td.textContent.trim().replace(/nan|inf/gi, '');
  return /\\d/.test(t) && !/[a-df-z]/i.test(t);
}).map(td => {
  const r = document.createRange(); r.selectNodeContents(td);
  const tops = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
  return {text: td.textContent, lines: tops.size, table: td.closest('table').id};
}).filter(c => c.lines > 1))()"""


def _demo_like_rows() -> pl.DataFrame:
    """The demo's shape: three backbones with long keys (one random), a probe on two protocols,
    kNN at four k values, a fine-tune, one seed each: the per-setting table has seven columns."""
    rows = []
    names = {LITE0: 0.81, "tf_efficientnet_lite1": 0.80, RANDOM: 0.75}
    for b, v in names.items():
        common = {"backbone": b, "dataset": "fashion-mnist", "metric": "top1", "n_eval": 300, "seed": 0}
        rows += [
            {**common, "kind": "probe", "protocol": "full", "value": v, "hparams": "{}"},
            {**common, "kind": "probe", "protocol": "vtab1k-sgd", "value": v - 0.013, "hparams": "{}"},
            {**common, "kind": "finetune", "protocol": "vtab1k-sgd", "value": v - 0.6, "hparams": '{"scaled": true}'},
        ]
        rows += [
            {**common, "kind": "knn", "protocol": f"knn-k{k}", "value": v - 0.0011 * k, "hparams": "{}"}
            for k in (10, 20, 100, 200)
        ]
    return pl.DataFrame(rows)


@pytest.mark.slow
def test_no_number_wraps_mid_value_at_1400_px(tmp_path):
    """The demo report at 1,400 px broke "0.7527" over two lines; rendered in headless
    Chromium, no numeric cell of any table spans two lines, and a screenshot is taken."""
    sys.path.insert(0, str(Path(__file__).parent))
    from cdp import Browser, find_chromium

    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium not installed (the CI image installs Debian's chromium)")
    cat = _catalog({LITE0: 1016.0, "tf_efficientnet_lite1": 1038.0, RANDOM: 1433.0})
    html = write_report(tmp_path / "r.html", _demo_like_rows(), cat, rank_kwargs={"n_boot": 100})
    with Browser(exe, tmp_path / "profile") as b:
        b.open(html.as_uri(), width=1400, height=900)
        n_numeric = b.evaluate("document.querySelectorAll('td.n').length")
        wrapped = b.evaluate(WRAPPED_NUMBERS)
        shot = b.screenshot(tmp_path / "report.png")
    assert n_numeric > 50
    assert wrapped == [], json.dumps(wrapped[:5])
    assert shot.stat().st_size > 10_000
