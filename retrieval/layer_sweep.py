"""Layer sweeps of retrieval and k-NN (``featcache retrieve --layers``, issue 56).

Each stored per-layer kind (:func:`featcache.core.layers.select_layers`) is run exactly as
``retrieve --kind layer{i}_...`` would run it (:func:`~featcache.retrieval.run.run_retrieval`
itself), twice: with ``layer_val_split`` as the queries (the selection, against the same
gallery; never the ``--query`` split) and with ``query_split`` (what is reported). Per backbone
and run (each k-NN ``k``, each relevance protocol) the layer with the best validation value of
:data:`SELECTION_METRICS` is selected. The reported rows of every layer are written, marked in
hparams as ``probe --layers`` marks them (``layer``, ``layer_kind``, ``layer_role``,
``layer_val_score``, ``layer_selection``); the validation runs' rows are not written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from featcache.core.layers import select_layers, stored_layers
from featcache.errors import DataError
from featcache.retrieval.config import RetrievalConfig

if TYPE_CHECKING:
    import polars as pl

__all__ = ["SELECTION_METRICS", "run_retrieval_layers"]

log = logging.getLogger(__name__)

#: a single-layer run: :func:`featcache.retrieval.run.run_retrieval` (passed in: run imports this module)
Runner = Callable[[RetrievalConfig], "pl.DataFrame"]

#: row kind -> the metrics a layer is selected on, the first a run has (mAP over the full
#: ranking; a top-K-only run: its mrr, else recall@1; k-NN: top-1)
SELECTION_METRICS = {"retrieval": ("map", "mrr", "recall@1"), "knn": ("top1",)}


def _scores(val: pl.DataFrame) -> dict[tuple[str, str], tuple[str, float]]:
    """(kind, protocol) -> (selection metric, its value) of one layer's validation rows."""
    out = {}
    for (kind, protocol), g in val.group_by(["kind", "protocol"]):
        have = dict(zip(g["metric"].to_list(), g["value"].to_list()))
        metric = next((m for m in SELECTION_METRICS.get(str(kind), ()) if m in have), None)
        if metric is not None:
            out[(str(kind), str(protocol))] = (metric, float(have[metric]))
    return out


def _sweep_backbone(cfg: RetrievalConfig, cache, b: str, run_retrieval: Runner) -> list[dict]:
    """Every selected layer of ``b`` run on the validation and the reported queries; marked rows."""
    from featcache.core.progress import tqdm
    from featcache.core.results import make_run_id

    assert cfg.layers is not None  # run_retrieval_layers runs only with --layers
    layers = select_layers(cache.kinds(b, cfg.dataset, cfg.query_split), cfg.layers, cfg.layer_part)
    runs = []
    for i, kind in tqdm(layers, desc=f"{b} layers", disable=not cfg.progress):
        one = replace(cfg, backbones=(b,), kind=kind, layers=None, results_path=None)
        val = run_retrieval(replace(one, query_split=cfg.layer_val_split))
        runs.append((i, kind, _scores(val), run_retrieval(one)))
    best: dict[tuple[str, str], int] = {}
    for key in runs[0][2]:
        best[key] = int(np.argmax([r[2][key][1] for r in runs]))  # ties: the shallowest layer
    out = []
    for n, (i, kind, scores, df) in enumerate(runs):
        for r in df.iter_rows(named=True):
            key = (r["kind"], r["protocol"])
            if key not in scores:
                continue  # a run without a selection metric (index_recall rows)
            metric, score = scores[key]
            sel = {"rule": "val-queries", "metric": metric, "split": cfg.layer_val_split, "layers": len(layers)}
            sel["selected"] = layers[best[key]][0]
            marks = {"layer": i, "layer_kind": kind, "layer_role": "selected" if n == best[key] else "curve"}
            marks.update(layer_val_score=score, layer_selection=sel)
            rid = make_run_id(layer_sweep=r["run_id"], layers=[k for _, k in layers], val=cfg.layer_val_split)
            out.append({**r, "run_id": rid, "hparams": {**json.loads(r["hparams"]), **marks}})
    return out


def run_retrieval_layers(cfg: RetrievalConfig, run_retrieval: Runner, open_backbones: Callable) -> pl.DataFrame:
    """Retrieval and k-NN on every layer of ``cfg.layers`` for each backbone with
    ``run_retrieval`` (:func:`featcache.retrieval.run.run_retrieval`, which calls this for a
    config with ``layers``, and its ``open_backbones``), one layer selected per backbone and run
    on ``cfg.layer_val_split``; the marked rows of every layer, appended to
    ``cfg.results_path`` (the results schema)."""
    from featcache.core.results import check_results_path, rows_to_frame
    from featcache.core.stagerun import write_rows

    if cfg.kind != "pooled":
        raise DataError(f"--layers reads the per-layer kinds (layer<i>_<part>); drop --kind {cfg.kind}")
    if cfg.layer_val_split in (cfg.query_split, "same"):
        raise DataError(
            f"--layer-val-split {cfg.layer_val_split!r} is the reported --query split; select the layer on "
            "another split (e.g. val)"
        )
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)
    cache, backbones = open_backbones(cfg)
    if cfg.backbones is None:  # --all: the backbones that store per-layer kinds
        held = [b for b in backbones if stored_layers(cache.kinds(b, cfg.dataset, cfg.query_split), cfg.layer_part)]
        if len(held) < len(backbones):
            log.warning("--layers --all: %s store no per-layer kinds; skipped", sorted(set(backbones) - set(held)))
        backbones = held or backbones  # none: the sweep refuses the first, naming what it stores
    if cfg.layer_val_split not in cache.splits(cfg.dataset):
        raise DataError(
            f"--layers selects the layer with the {cfg.layer_val_split!r} split as queries, which {cfg.dataset} "
            f"does not have (splits {cache.splits(cfg.dataset)}); extract it or name another with --layer-val-split"
        )
    table = rows_to_frame([r for b in backbones for r in _sweep_backbone(cfg, cache, b, run_retrieval)])
    write_rows(cfg.results_path, table)
    return table
