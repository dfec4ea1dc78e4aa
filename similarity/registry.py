"""The measures ``featcache similarity --measures`` takes: one registration each, carrying all
the stage needs from it (a measure is one file: this one, or a module of your own)::

    @register_measure("cka_linear", text="linear CKA", statistic=LinearCKAStream)
    def cka_linear(stat, cfg):
        return stat.result()

- ``statistic`` given: the measure **streams**: ``statistic()`` is an accumulator that every
  row block is fed to (``update(x, y)``), in one pass shared by all the chosen streaming
  measures; measures naming the same statistic share one accumulator (linear and debiased
  CKA: one :class:`~featcache.similarity.streaming.LinearCKAStream`). The measure is
  ``fn(stat, cfg) -> value``; its rows record ``rows`` and ``block_rows``.
- no ``statistic``: the measure takes the aligned rows, ``fn(X, Y, cfg, budget) -> (value,
  details)``, and keeps its ``[n, n]`` Gram matrices or RDMs within ``budget``
  (:class:`Budget`): every row when they fit, else in blocks of rows when its exact value
  can be accumulated so, else an estimate, whose ``details`` then hold ``estimate``: one
  line saying which estimator on how many rows (the CLI prints it, the row records it).
- ``hparams(cfg)``: the options its rows record beside ``feature_kind`` (their run ids
  depend on them); ``text``: how the report names it (each row records it in its hparams as
  ``measure_text``, where the analysis reads it: the analysis imports no stage).

A measure of your own: ``register_measure`` in your module, imported before the config is
built; it is then in ``--help``, taken by ``--measures`` and computed by :func:`compare
<featcache.similarity.runner.compare>` (the default runs every registered measure).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.registry import Registry
from featcache.errors import ConfigError
from featcache.similarity.blocked import blocked_rbf_cka
from featcache.similarity.measures import rbf_cka, rsa
from featcache.similarity.streaming import LinearCKAStream, MinibatchCKA, take_rows

if TYPE_CHECKING:
    from featcache.similarity.config import SimilarityConfig

__all__ = ["EXACT_MAX_ROWS", "MAX_MINIBATCH", "MEASURES", "Budget", "Measure", "register_measure"]

#: largest minibatch of the kernel estimator
MAX_MINIBATCH = 4096
#: most rows whose RBF CKA is computed exactly in row blocks when the Gram matrices do not
#: fit (its cost grows as rows squared: past this, the minibatch estimate, recorded as such)
EXACT_MAX_ROWS = 50_000


@dataclass(frozen=True)
class Budget:
    """How ``max_memory`` bytes are spent for features of widths ``dx`` and ``dy``."""

    memory: int
    dx: int
    dy: int

    @property
    def block_rows(self) -> int:
        """Rows per streamed block: float64 copies of both sides, three times over, in a quarter."""
        return int(min(65536, max(256, self.memory // (4 * 3 * 8 * (self.dx + self.dy)))))

    @property
    def gram_rows(self) -> int:
        """Most rows whose ``[n, n]`` float64 Gram matrices or RDMs (six of them) fit."""
        return int(max(16, math.isqrt(self.memory // 48)))

    @property
    def sample_rows(self) -> int:
        """Most rows of both sides (float64) held at once for the kernel estimator, in half."""
        return int(max(self.gram_rows, self.memory // (2 * 8 * (self.dx + self.dy))))


def _no_hparams(cfg: SimilarityConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Measure:
    """A registered measure: its function, the report's name for it (``text``), the
    accumulator it streams through (``statistic``; None: it takes the rows within a budget)
    and the options its rows record (``hparams(cfg)``)."""

    fn: Callable[..., Any]
    text: str
    statistic: Callable[[], Any] | None = None
    hparams: Callable[[SimilarityConfig], dict[str, Any]] = _no_hparams

    @property
    def streams(self) -> bool:
        """Whether it streams row blocks (else it holds a sample's Gram matrices or RDMs)."""
        return self.statistic is not None


#: the measures by name, in the order their rows are written
MEASURES: Registry[Measure] = Registry("similarity measure", ConfigError, key=lambda m: m.fn)


def register_measure(
    name: str,
    *,
    text: str,
    statistic: Callable[[], Any] | None = None,
    hparams: Callable[[SimilarityConfig], dict[str, Any]] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as the measure ``name`` (see the module docstring)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        MEASURES.register(name, Measure(fn, text, statistic, hparams or _no_hparams), note=text)
        return fn

    return deco


# --------------------------------------------------------------------------- the built-in measures
def _sample(n: int, k: int, seed: int, salt: int) -> np.ndarray:
    """``k`` of ``n`` row positions, sorted (store order: each chunk decoded once)."""
    if k >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, salt]).choice(n, k, replace=False))


def _rows(X: Any, idx: np.ndarray) -> np.ndarray:
    return np.asarray(take_rows(X, idx), np.float64)


def _sampled(cfg: SimilarityConfig) -> dict[str, Any]:
    """What a measure on a sample of the rows depends on: the bound and the sample's seed."""
    return {"max_memory": cfg.memory, "seed": cfg.seed}


@register_measure("cka_linear", text="linear CKA", statistic=LinearCKAStream)
def cka_linear(stat: LinearCKAStream, cfg: SimilarityConfig) -> float:
    """Linear CKA over every row (streamed)."""
    return stat.result()


@register_measure("cka_debiased", text="debiased linear CKA", statistic=LinearCKAStream)
def cka_debiased(stat: LinearCKAStream, cfg: SimilarityConfig) -> float:
    """Linear CKA with the unbiased HSIC over every row (streamed)."""
    return stat.result(debiased=True)


def _rbf_hparams(cfg: SimilarityConfig) -> dict[str, Any]:
    return {"rbf_threshold": None if cfg.rbf_sigma else cfg.rbf_threshold, "rbf_sigma": cfg.rbf_sigma, **_sampled(cfg)}


@register_measure("cka_rbf", text="RBF CKA", hparams=_rbf_hparams)
def cka_rbf(X: Any, Y: Any, cfg: SimilarityConfig, budget: Budget) -> tuple[float, dict[str, Any]]:
    """RBF CKA on every row: in memory when the Gram matrices fit, else accumulated in row
    blocks (the same value, up to float64 rounding); past :data:`EXACT_MAX_ROWS` rows,
    google-research's minibatch estimator on a seeded sample (recorded as an estimate)."""
    n = X.shape[0]
    kw: dict[str, Any] = {"sigma": cfg.rbf_sigma} if cfg.rbf_sigma else {"threshold": cfg.rbf_threshold}
    if n <= budget.gram_rows:
        return rbf_cka(np.asarray(X), np.asarray(Y), **kw), {"rbf_estimator": "full", "rows": n}
    if n <= EXACT_MAX_ROWS:
        value, info = blocked_rbf_cka(X, Y, cfg.rbf_threshold, cfg.rbf_sigma, budget.memory)
        return value, {"rbf_estimator": "blocks", "rows": n, **info}
    idx = _sample(n, budget.sample_rows, cfg.seed, 1)
    x, y = _rows(X, idx), _rows(Y, idx)
    perm = np.random.default_rng([cfg.seed, 2]).permutation(idx.size)
    b = min(MAX_MINIBATCH, budget.gram_rows)
    est = MinibatchCKA("rbf", cfg.rbf_threshold, cfg.rbf_sigma)
    for s in range(0, perm.size, b):
        est.update(x[perm[s : s + b]], y[perm[s : s + b]])
    rows = int(idx.size - est.skipped)
    note = f"google-research's minibatch estimate on {rows} of {n} rows (minibatches of {b}, seed {cfg.seed})"
    return est.result(), {"rbf_estimator": "minibatch", "rows": rows, "minibatch": b, "estimate": note}


def _rsa_hparams(cfg: SimilarityConfig) -> dict[str, Any]:
    return {**_sampled(cfg), "rdm": cfg.rdm}


@register_measure("rsa_spearman", text="RSA (Spearman of RDMs)", hparams=_rsa_hparams)
def rsa_spearman(X: Any, Y: Any, cfg: SimilarityConfig, budget: Budget) -> tuple[float, dict[str, Any]]:
    """RSA on the RDMs of every row when they fit, else of a seeded sample of the rows that
    fit (recorded as an estimate: Spearman's ranks of all ``n^2 / 2`` dissimilarities need
    them all at once)."""
    n = int(X.shape[0])
    idx = _sample(n, budget.gram_rows, cfg.seed, 3)
    value = rsa(_rows(X, idx), _rows(Y, idx), cfg.rdm)
    info: dict[str, Any] = {"rows": int(idx.size)}
    if idx.size < n:
        info["estimate"] = f"RDMs of a sample of {idx.size} of {n} rows (seed {cfg.seed})"
    return value, info
