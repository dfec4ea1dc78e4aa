"""Linear probes on the train split's augmented views (``--views K``, issue 46).

``featcache extract --views K`` stores view ``v`` of the train split as split ``train@view{v}``
(:mod:`featcache.extract.views`). A probe run with ``ProbeConfig(views=K)`` reads views
``0 .. K-1``, aligned with the train split's valid rows by id, and

* an epoch-based solver (``bob-linear``; ``dinov2-linear``) trains each epoch on ONE view of
  every training image, drawn by :func:`view_choice` (seeded by the run's seed and the epoch);
* the L-BFGS solver (``full``, ``fewshot:N``, ``subset:F%``) fits on all K views of every
  training row with sample weight 1/K (:func:`stack_views`), and selects C on the
  deterministic validation features.

Evaluation always reads the deterministic features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featcache.errors import NotInStoreError, ProbeError

__all__ = ["PassViews", "check_view_solver", "load_views", "stack_views", "view_choice", "view_splits"]

_DRAW_TAG = 0x76696577  # "view": keeps this stream apart from any other seeded by (seed, epoch)


def view_choice(seed: int, epoch: int, n_rows: int, n_views: int) -> np.ndarray:
    """The view each of ``n_rows`` training rows is seen in during ``epoch``: ``int64 [n_rows]``
    in ``[0, n_views)``, uniform and independent per row, the same for the same arguments."""
    if n_views < 1:
        raise ProbeError(f"view_choice needs n_views >= 1 (got {n_views})")
    rng = np.random.default_rng([int(seed), int(epoch), _DRAW_TAG])
    return rng.integers(0, n_views, size=int(n_rows), dtype=np.int64)


class PassViews:
    """The view of each row occurrence in an endless stream of batches (``dinov2-linear``'s
    sampler): a row's k-th occurrence is in the k-th pass over the rows, and is seen in view
    ``view_choice(seed, k, n_rows, n_views)[row]`` (one view per image per pass, seeded)."""

    def __init__(self, seed: int, n_rows: int, n_views: int):
        self.seed, self.n, self.k = int(seed), int(n_rows), int(n_views)
        self.count = np.zeros(self.n, np.int64)
        self._draws: dict[int, np.ndarray] = {}

    def views_of(self, idx: np.ndarray) -> np.ndarray:
        """The view of each row of the next batch ``idx`` (a row twice in one batch, across a
        pass boundary, gets its two passes' views)."""
        idx = np.asarray(idx, np.int64)
        order = np.argsort(idx, kind="stable")
        s = idx[order]
        pos = np.arange(s.size)
        start = np.maximum.accumulate(np.where(np.r_[True, s[1:] != s[:-1]], pos, 0))
        occ = np.empty_like(idx)
        occ[order] = self.count[s] + pos - start
        np.add.at(self.count, idx, 1)
        out = np.empty_like(idx)
        for p in np.unique(occ):
            if p not in self._draws:
                self._draws = {q: d for q, d in self._draws.items() if q >= p - 1}
                self._draws[int(p)] = view_choice(self.seed, int(p), self.n, self.k)
            m = occ == p
            out[m] = self._draws[int(p)][idx[m]]
        return out


def stack_views(views: Sequence[Any], y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All views of the training rows stacked (view-major) with their labels repeated.

    Every stacked row stands for one view with sample weight 1/K; the L-BFGS objective
    ``C * sum_i w_i loss_i + |W|^2 / 2`` with ``w_i = 1/K`` on the stacked rows is the
    unweighted one at ``C / K`` (so callers divide the C grid by K; same optimum, same
    standardisation statistics, since the weights are uniform).
    """
    X = np.concatenate([np.asarray(v, np.float32) for v in views])
    return X, np.tile(np.asarray(y), len(views))


def view_splits(train_split: str, views: int) -> list[str]:
    """The split names of views ``0 .. views-1`` of ``train_split``."""
    from featcache.data.views import view_split

    return [view_split(train_split, v) for v in range(views)]


def load_views(
    cache: Any,
    backbone: str,
    dataset: str,
    cfg: Any,
    train: Any,
    names: list[str],
    load_split: Callable[..., Any],
    lazy: bool,
) -> list:
    """Views ``0 .. cfg.views-1`` of ``cfg.train_split`` (``load_split``: the runner's loader of
    one split's valid rows in id order), each row-aligned with ``train``; a store with fewer
    views is refused with the extract command that adds them."""
    out = []
    for v, name in enumerate(view_splits(cfg.train_split, cfg.views)):
        try:
            got = load_split(cache, backbone, dataset, name, cfg.kind, names, lazy=lazy)
        except NotInStoreError:
            raise _too_few(cache, backbone, dataset, cfg, v) from None
        if not np.array_equal(got.ids, train.ids):
            raise ProbeError(
                f"{backbone}/{dataset}/{name}: its valid rows differ from {cfg.train_split}'s "
                f"({got.ids.size} vs {train.ids.size}); re-extract the views with --views {cfg.views} --overwrite"
            )
        out.append(got)
    return out


def _too_few(cache: Any, backbone: str, dataset: str, cfg: Any, have: int) -> NotInStoreError:
    prov = cache.provenance(backbone, dataset, cfg.train_split, cfg.kind)
    seed = None
    if have:
        first = cache.provenance(backbone, dataset, f"{cfg.train_split}@view0", cfg.kind)
        seed = (first.data_config or {}).get("view", {}).get("seed")
    cmd = extract_command(str(cache.path), backbone, dataset, prov, cfg.views, seed)
    return NotInStoreError(
        f"{backbone}/{dataset}: --views {cfg.views} needs {cfg.views} augmented views of {cfg.train_split} "
        f"({cfg.kind}); the store has {have}. Add them with: {cmd}"
    )


def extract_command(cache_path: str, backbone: str, dataset: str, prov: Any, views: int, seed: int | None) -> str:
    """The ``featcache extract`` command that adds the missing views to a store."""
    size = (prov.data_config or {}).get("input_size")
    parts = [
        "featcache extract",
        f"--model {prov.model_name}",
        f"--weights {prov.weights_source}",
        "--data DATA",
        f"--dataset-name {dataset}",
        f"--backbone-name {backbone}",
        "--split train",
        *([f"--input-size {size[-1]}"] if size else []),
        f"--features {prov.kind}",
        f"--views {views}",
        *([f"--view-seed {seed}"] if seed is not None else []),
        f"--cache {cache_path}",
    ]
    return " ".join(parts)


def check_view_solver(solver: Any, proto: Any, views: int) -> None:
    """``--views`` only with a solver that trains on views (``register_solver(views=True)``;
    one line naming those solvers)."""
    if views and not solver.views:
        from featcache.probes.solver_registry import SOLVERS  # every one found (cfg.solver was looked up)

        ok = [n for n in SOLVERS if SOLVERS[n].views]
        raise ProbeError(
            f"--views {views}: protocol {proto.spec} (solver {proto.solver!r}) does not train on augmented views; "
            f"use a protocol of the solvers {ok} (e.g. full, fewshot:N, subset:F%, bob-linear or dinov2-linear), "
            "or drop --views"
        )
