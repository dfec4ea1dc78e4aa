"""Layer sweeps (``featcache probe --layers``, issue 56): one protocol run per stored layer.

Each stored per-layer kind (:func:`featcache.core.layers.select_layers`: ``layer{i}_cls``,
``layer{i}_avg``...) is probed exactly as a single-layer run with ``--kind layer{i}_...`` would
be (:func:`~featcache.probes.runner.run_probes` itself); the layer reported is chosen by the
protocol's :attr:`~featcache.core.protocols.Protocol.layer_selection` rule, which reads only the
validation data the protocol already holds out (:data:`LAYER_SCORERS`), never an eval split.
Every layer's rows are written, marked in ``hparams``: ``layer`` (the index), ``layer_kind``,
``layer_role`` (``selected`` for the chosen layer, ``curve`` for the others; the analysis ranks
the selected rows and draws the curve from all of them), ``layer_val_score`` and
``layer_selection`` (the rule, its metric and the layer chosen).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.layers import select_layers
from featcache.core.protocols import LAYER_SELECTIONS, Protocol
from featcache.core.registry import Registry
from featcache.errors import NotInStoreError, ProbeError
from featcache.probes.config import ProbeConfig

if TYPE_CHECKING:
    import polars as pl

__all__ = ["LAYER_SCORERS", "layer_marks", "run_layer_sweep"]

log = logging.getLogger(__name__)

#: a single-layer run: :func:`featcache.probes.runner.run_probes` (passed in: the runner imports this module)
Runner = Callable[[ProbeConfig], "pl.DataFrame"]

#: rule name (:attr:`Protocol.layer_selection`) -> ``fn(rows, metric, val_split) -> score`` of one
#: layer's run rows (higher is better; ``val_split``: the split a ``val-split`` rule evaluates)
LAYER_SCORERS: Registry[Callable[..., float]] = Registry("layer selection", ProbeError)


@LAYER_SCORERS.register("val-score", note=LAYER_SELECTIONS["val-score"])
def val_score(rows: pl.DataFrame, metric: str, val_split: str | None = None) -> float:
    """The mean over seeds of ``hparams["val_<metric>"]``: the score on the validation rows the
    protocol's own selection (C, lr, head) was made on."""
    key = f"val_{metric}"
    runs = {r: json.loads(h) for r, h, s in rows.select("run_id", "hparams", "seed").iter_rows() if s >= 0}
    missing = [r for r, hp in runs.items() if key not in hp]
    if missing or not runs:
        raise ProbeError(
            f"layer selection val-score reads hparams[{key!r}], which run {missing[:1]} does not record; "
            "its protocol selects nothing on validation: give it layer_selection='val-split'"
        )
    return float(np.mean([hp[key] for hp in runs.values()]))


@LAYER_SCORERS.register("val-split", note=LAYER_SELECTIONS["val-split"])
def val_split_score(rows: pl.DataFrame, metric: str, val_split: str | None = None) -> float:
    """The mean over seeds of ``metric`` on the dataset's val split (evaluated as one more split)."""
    import polars as pl

    sub = rows.filter((pl.col("eval_split") == val_split) & (pl.col("metric") == metric) & (pl.col("seed") >= 0))
    if sub.height == 0:
        raise ProbeError(f"layer selection val-split: no {metric} row on split {val_split!r}")
    return float(sub["value"].mean())  # type: ignore[arg-type]


def _val_split(cache, cfg: ProbeConfig, proto: Protocol) -> str | None:
    """The split a ``val-split`` rule evaluates (None for the other rules); missing: one line."""
    if proto.layer_selection != "val-split":
        return None
    splits = cache.splits(cfg.dataset)
    name = next((s for s in (cfg.val_split, "validation") if s in splits), None)
    if name is None or name in cfg.eval_splits:
        raise NotInStoreError(
            f"{proto.spec} holds out nothing, so its layer sweep selects on the dataset's val split "
            f"{cfg.val_split!r}, which {cfg.dataset} does not have apart from the eval splits (has {splits}); "
            "extract a val split (or name it with --val-split), or sweep with --protocol full"
        )
    return name


def layer_marks(i: int, kind: str, role: str, score: float, selection: dict[str, Any]) -> dict[str, Any]:
    """What a sweep adds to a layer's rows' ``hparams``."""
    return {"layer": i, "layer_kind": kind, "layer_role": role, "layer_val_score": score, "layer_selection": selection}


def _sweep_backbone(config: ProbeConfig, proto: Protocol, caches, b: str, run_probes: Runner) -> list[dict]:
    """Every selected layer of ``b`` probed, the layer chosen, the rows marked."""
    from featcache.core.progress import tqdm
    from featcache.core.results import make_run_id
    from featcache.probes.store_lookup import cache_for

    c = cache_for(caches, b, config.dataset)
    assert config.layers is not None  # run_layer_sweep runs only with --layers
    layers = select_layers(c.kinds(b, config.dataset, config.train_split), config.layers, config.layer_part)
    val = _val_split(c, config, proto)
    evals = (*config.eval_splits, *([val] if val else []))
    runs = []
    for i, kind in tqdm(layers, desc=f"{b} layers", disable=not config.progress):
        one = replace(config, backbones=(b,), kind=kind, layers=None, results_path=None, predictions=None)
        runs.append((i, kind, run_probes(replace(one, eval_splits=evals))))
    metric = json.loads(runs[0][2]["hparams"][0])["task_metric"]
    scorer = LAYER_SCORERS[proto.layer_selection]
    scores = [scorer(df, metric, val) for _, _, df in runs]
    best = int(np.argmax(scores))  # ties: the shallowest layer
    selection = {"rule": proto.layer_selection, "metric": metric, "selected": layers[best][0], "layers": len(layers)}
    if val:
        selection["split"] = val
    log.info(
        "%s %s %s: layer %d selected (val %s %.4f)",
        b,
        config.dataset,
        proto.spec,
        layers[best][0],
        metric,
        scores[best],
    )
    out = []
    for n, ((i, kind, df), score) in enumerate(zip(runs, scores)):
        marks = layer_marks(i, kind, "selected" if n == best else "curve", score, selection)
        for r in df.iter_rows(named=True):
            if r["eval_split"] == val:
                continue  # the selection's own evidence: recorded as layer_val_score
            sweep = make_run_id(layer_sweep=r["run_id"], layers=[k for _, k in layers], rule=proto.layer_selection)
            out.append({**r, "run_id": sweep, "hparams": {**json.loads(r["hparams"]), **marks}})
    return out


def _sweep_ids(config: ProbeConfig, proto: Protocol, caches, b: str) -> list[str]:
    """The run ids a sweep of ``b`` writes, from the store's provenance records alone (the
    single-layer runs' ids, :func:`~featcache.probes.store_lookup.run_ids`, and the layer list)."""
    from featcache.core.results import make_run_id
    from featcache.probes.store_lookup import cache_for, run_ids

    assert config.layers is not None
    c = cache_for(caches, b, config.dataset)
    layers = select_layers(c.kinds(b, config.dataset, config.train_split), config.layers, config.layer_part)
    kinds = [k for _, k in layers]
    out = []
    for kind in kinds:
        one = replace(config, backbones=(b,), kind=kind, layers=None, results_path=None, predictions=None)
        for rid in run_ids(one).values():
            out.append(make_run_id(layer_sweep=rid, layers=kinds, rule=proto.layer_selection))
    return out


def _with_layers(caches, cfg: ProbeConfig, backbones: list[str]) -> list[str]:
    """``--all``: the backbones that store per-layer kinds (the others named in one warning);
    named backbones as given (one without layers is refused by the sweep, naming what it has)."""
    from featcache.core.layers import stored_layers
    from featcache.probes.store_lookup import cache_for

    if list(cfg.backbones) != ["all"]:
        return backbones

    def held(b: str) -> bool:
        kinds = cache_for(caches, b, cfg.dataset).kinds(b, cfg.dataset, cfg.train_split)
        return bool(stored_layers(kinds, cfg.layer_part))

    keep = [b for b in backbones if held(b)]
    if not keep:
        raise NotInStoreError(
            f"no backbone stores per-layer kinds for {cfg.dataset}/{cfg.train_split}; extract them with "
            "--features layers:all (or layers:1,4,-1) first"
        )
    if len(keep) < len(backbones):
        log.warning("--layers --all: %s store no per-layer kinds; skipped", sorted(set(backbones) - set(keep)))
    return keep


def run_layer_sweep(config: ProbeConfig, run_probes: Runner) -> pl.DataFrame:
    """Probe every layer of ``config.layers`` for each backbone (``config.layer_part``) with
    ``run_probes`` (:func:`featcache.probes.runner.run_probes`, which calls this for a config
    with ``layers``), select one layer per backbone by the protocol's rule, and append every
    layer's marked rows to ``config.results_path``; returns them (the results schema). A
    backbone whose sweep rows are all in the table already is skipped (its stored rows
    returned) unless ``config.force``."""
    from featcache.core.results import check_results_path, read_results, rows_to_frame
    from featcache.core.stagerun import finished, write_rows
    from featcache.probes.store_lookup import open_caches, resolve_backbones

    proto, cfg = config.resolve()
    if cfg.kind not in ("pooled", proto.kind):
        raise ProbeError(f"--layers reads the per-layer kinds (layer<i>_<part>); drop --kind {cfg.kind}")
    if cfg.predictions is not None:
        raise ProbeError(
            "--predictions with --layers: run the selected layer alone with --kind layer<i>_<part> --predictions FILE"
        )
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)
    caches = open_caches(cfg.cache)
    done = finished(cfg.results_path, cfg.force)
    rows, kept = [], []
    for b in _with_layers(caches, cfg, resolve_backbones(caches, cfg)):
        ids = _sweep_ids(config, proto, caches, b) if done else []
        if ids and set(ids) <= done:
            log.info(
                "skip %s/%s %s --layers %s: already in %s", b, cfg.dataset, proto.spec, cfg.layers, cfg.results_path
            )
            kept += ids
        else:
            rows += _sweep_backbone(config, proto, caches, b, run_probes)
    table = rows_to_frame(rows)
    write_rows(cfg.results_path, table)
    if kept and cfg.results_path is not None:
        import polars as pl

        stored = read_results(cfg.results_path).filter(pl.col("run_id").is_in(kept))
        table = pl.concat([stored, table])
    return table
