"""Layer-by-layer CKA heatmaps, read from a results table.

``featcache similarity --layers`` writes one ``kind="similarity"`` row per layer pair and
measure: ``backbone`` the first backbone, ``protocol`` ``layers:vs:<second>``, the layers in
its hparams (``layer_a``, ``layer_b``, ``kind_a``, ``kind_b``) and the measure's name for the
report (``measure_text``). :func:`layer_cka_matrices` lays them out as one ``[L_A, L_B]``
matrix per pair, dataset, split and measure; :func:`layer_cka_heatmap` draws one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PROTOCOL_PREFIX", "LayerCKAMatrix", "layer_cka_heatmap", "layer_cka_matrices"]

#: the protocol prefix of layer CKA rows (the backbone-level rows' is ``vs:``)
PROTOCOL_PREFIX = "layers:vs:"


@dataclass(frozen=True)
class LayerCKAMatrix:
    """One measure between every layer of ``backbone_a`` (rows) and of ``backbone_b``
    (columns) on ``dataset``/``split``; NaN where a pair was not run."""

    dataset: str
    split: str
    metric: str
    backbone_a: str
    backbone_b: str
    layers_a: tuple[int, ...]
    layers_b: tuple[int, ...]
    values: np.ndarray
    text: str = ""
    route: str = ""

    @property
    def title(self) -> str:
        return f"{self.text or self.metric}: {self.backbone_a} vs {self.backbone_b} on {self.dataset}/{self.split}"


def _hp(h: Any) -> dict[str, Any]:
    return json.loads(h) if isinstance(h, str) else dict(h or {})


def _matrix(key: tuple, g) -> LayerCKAMatrix:
    ds, split, metric, a, protocol = key
    hps = [_hp(h) for h in g["hparams"].to_list()]
    la = tuple(sorted({int(h["layer_a"]) for h in hps}))
    lb = tuple(sorted({int(h["layer_b"]) for h in hps}))
    pa, pb = {v: i for i, v in enumerate(la)}, {v: i for i, v in enumerate(lb)}
    M = np.full((len(la), len(lb)), np.nan)
    for h, v in zip(hps, g["value"].to_list(), strict=True):
        M[pa[int(h["layer_a"])], pb[int(h["layer_b"])]] = v
    text = next((str(h["measure_text"]) for h in reversed(hps) if h.get("measure_text")), "")
    route = next((str(h["route"]) for h in reversed(hps) if h.get("route")), "")
    b = protocol[len(PROTOCOL_PREFIX) :]
    return LayerCKAMatrix(str(ds), str(split), str(metric), str(a), b, la, lb, M, text, route)


def layer_cka_matrices(frame: Any) -> list[LayerCKAMatrix]:
    """The layer CKA rows of ``frame`` (a results table as read) as matrices, the most recent
    row of each layer pair, sorted by dataset, split, pair and measure."""
    import polars as pl

    if frame is None or not {"kind", "protocol", "hparams"} <= set(frame.columns):
        return []
    rows = frame.filter((pl.col("kind") == "similarity") & pl.col("protocol").str.starts_with(PROTOCOL_PREFIX))
    if not rows.height:
        return []
    rows = rows.sort("created_at").unique("run_id", keep="last")
    keys = ["dataset", "eval_split", "metric", "backbone", "protocol"]
    out = [_matrix(tuple(k), g) for k, g in rows.group_by(keys)]
    return sorted(out, key=lambda m: (m.dataset, m.split, m.backbone_a, m.backbone_b, m.metric))


def layer_cka_heatmap(m: LayerCKAMatrix, path: str | os.PathLike) -> Path:
    """``m`` as a heatmap PNG at ``path`` (matplotlib Figure, no pyplot): ``backbone_a``'s
    layers up the rows from the first, ``backbone_b``'s along the columns; values written in
    when the grid is small."""
    from featcache.analysis import plots

    na, nb = len(m.layers_a), len(m.layers_b)
    fig = plots.new_figure(2.2 + 0.45 * nb, 1.6 + 0.4 * na)
    ax = fig.add_subplot()
    im = ax.imshow(m.values, origin="lower", vmin=0.0, vmax=1.0, cmap="magma", aspect="auto")
    ax.set_xticks(range(nb), [str(i) for i in m.layers_b], fontsize=7)
    ax.set_yticks(range(na), [str(i) for i in m.layers_a], fontsize=7)
    ax.set_xlabel(f"layer of {m.backbone_b}", fontsize=8)
    ax.set_ylabel(f"layer of {m.backbone_a}", fontsize=8)
    if na * nb <= 100:
        for i in range(na):
            for j in range(nb):
                v = m.values[i, j]
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
    fig.colorbar(im, ax=ax, label=m.metric)
    ax.set_title(m.title, fontsize=8)
    return plots.save_figure(fig, path)
