"""Did an approximate index change the backbone ranking? For every retrieval setting (dataset,
protocol, gallery and query split) and every index run of it (``hparams.index``: a FAISS
factory from ``featcache retrieve --index``), Kendall's tau-b between the backbones' scores
under the index and under exact search (the rows of the same setting without an index), and
whether the order of the backbones changed. Reads the results table only.

>>> from featcache.analysis.index_effect import index_rank_change
>>> table = index_rank_change("results.parquet", metric="map@10")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os

import polars as pl

from featcache.analysis.stats import kendall_tau_b
from featcache.errors import ResultsError

__all__ = ["index_rank_change"]

SETTING = ["dataset", "protocol", "train_split", "eval_split"]


def _factory(hparams: str | dict | None) -> str:
    """The index of a row ("exact" without one): its factory as built (``auto``'s choice too)."""
    if hparams is None:
        return "exact"
    h = json.loads(hparams) if isinstance(hparams, str) else hparams
    idx = (h or {}).get("index")
    if not idx:
        return "exact"
    return idx["factory"] if idx.get("requested") in (None, idx["factory"]) else f"{idx['requested']}:{idx['factory']}"


def index_rank_change(results: str | os.PathLike | pl.DataFrame, metric: str = "map@10") -> pl.DataFrame:
    """One row per setting x index: ``n_backbones``, ``kendall_tau`` (tau-b of the index's
    scores against exact search's, over the backbones both have), ``p_value``,
    ``ranking_changed`` (the backbones' order differs, ties broken by name) and the exact
    and index orders. Exact rows come from the same table (``featcache retrieve
    --top-k-only`` without ``--index``): an index setting without them is a ResultsError."""
    from featcache.core.results import read_results

    df = results if isinstance(results, pl.DataFrame) else read_results(results)
    df = df.filter((pl.col("kind") == "retrieval") & (pl.col("metric") == metric))
    if df.is_empty():
        raise ResultsError(f"no retrieval rows with metric {metric!r}; give one the rows hold (map@10, recall@5 ...)")
    df = df.with_columns(pl.col("hparams").map_elements(_factory, return_dtype=pl.Utf8).alias("index"))
    out = []
    for key, g in df.group_by(SETTING, maintain_order=True):
        exact = g.filter(pl.col("index") == "exact").group_by("backbone").agg(pl.col("value").median())
        for (name,), a in g.filter(pl.col("index") != "exact").group_by(["index"], maintain_order=True):
            if exact.is_empty():
                raise ResultsError(
                    f"{dict(zip(SETTING, key))}: index {name} has no exact rows to compare with; run "
                    "`featcache retrieve --top-k-only` without --index on the same backbones"
                )
            a = a.group_by("backbone").agg(pl.col("value").median())
            j = exact.join(a, on="backbone", suffix="_index").sort("backbone")
            if j.height < 2:
                continue
            tau, p = kendall_tau_b(j["value"].to_numpy(), j["value_index"].to_numpy())
            order_e = j.sort(["value", "backbone"], descending=[True, False])["backbone"].to_list()
            order_a = j.sort(["value_index", "backbone"], descending=[True, False])["backbone"].to_list()
            out.append(
                {
                    **dict(zip(SETTING, key)),
                    "index": name,
                    "metric": metric,
                    "n_backbones": j.height,
                    "kendall_tau": tau,
                    "p_value": p,
                    "ranking_changed": order_e != order_a,
                    "exact_order": " > ".join(order_e),
                    "index_order": " > ".join(order_a),
                }
            )
    return pl.DataFrame(out)
