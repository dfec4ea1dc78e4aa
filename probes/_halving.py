"""A C sweep that costs about two fits: a loose, early-stopped scan of the warm-started
regularisation path, then a climb along the path at full tolerance from the scan's best.

Round 0 *scans* the path: C values are fitted one at a time in increasing order, each
from its smaller neighbour's coefficients, to a loose tolerance (``scan_tol``, e.g. 10x
the sweep's). Along the path this is a continuation method: each C starts close to its
(loose) optimum, so the whole scan costs about one fit. The scan stops once ``patience``
C values have scored clearly (more than ``margin``) below the best validation top-1 seen so
far (a flat stretch, such as the smallest C values all predicting one class, does not count); the larger
C values are dropped unfitted ("past the scan's peak"): they are the expensive end of the
path (weak regularisation, ill-conditioned) and lose on a curve that has turned over.

Round 1 *climbs*: the scan's best C continues from its own coefficients to the full
tolerance; then the path is walked from it at full tolerance, each C from its refined
neighbour, upwards while validation top-1 beats the best by more than ``margin`` (0.1
point), stopping after ``climb_patience`` C values that do not, and downwards instead when
nothing above won. The loose scan tends to peak a C value or two low (a loose head at large
C is under-fitted), which the climb corrects at the price of a few neighbour fits. A C whose
warm start already meets the tolerance (0 iterations: its neighbour's head, the same
score) is no evidence and costs no patience. The selection is the smallest refined C within
``margin`` of the best refined score.

Cost is counted in head-iterations (one head, one L-BFGS iteration over the training
rows): at ImageNet scale the GEMMs ``X @ W`` dominate, so head-iterations are wall time up
to a constant. The exhaustive sweep converges every C to the full tolerance, and near and
above the best C each of them costs a large fraction of a fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from featcache.errors import ProbeError

log = logging.getLogger(__name__)

KEPT = "refined"
SCANNED = "scanned only (loose tolerance)"
PAST_PEAK = "past the scan's peak (not fitted)"


@dataclass
class HalvingOutcome:
    heads: list  # standardised-space (W [D, K], b [K]) per C; None: never fitted
    n_iter: list[int]
    converged: list[bool]  # to the full tolerance (scanned-only C: False)
    val: list[float]  # last validation top-1 per C (scanned-only: the scan's; never fitted: nan)
    best_index: int
    rounds: list[dict] = field(default_factory=list)
    status: list[str] = field(default_factory=list)  # KEPT, or why the C was dropped

    @property
    def head_iters(self) -> int:
        return int(sum(self.n_iter))


def best_of(idx, val) -> int:
    """The index of ``idx`` with the highest ``val`` (ties: the smallest index = smaller C)."""
    return min(idx, key=lambda i: (-val[i], i))


def check_schedule(climb_patience: int, patience: int | None, scan_tol: float, tol: float) -> None:
    """ProbeError for a schedule the sweep cannot run (before any fitting starts)."""
    if climb_patience < 1:
        raise ProbeError(f"halving_climb must be >= 1 (got {climb_patience}): C values the climb tries past its best")
    if patience is not None and patience < 1:
        raise ProbeError(f"halving_patience must be >= 1, or None to scan the whole grid (got {patience})")
    if not scan_tol >= tol > 0:
        raise ProbeError(
            f"halving_scan_tol must be >= the sweep tolerance > 0 (got {scan_tol} and {tol}); "
            "the scan is the loose pass"
        )


def _scan(
    fit: Callable, score: Callable, n_heads: int, tol: float, patience: int | None, st: dict, margin: float
) -> list[int]:
    """Round 0: walk the path upwards to tolerance ``tol``, each C started from its
    smaller neighbour; returns the scanned C (the rest are past the scan's peak).

    Only a C that scores more than ``margin`` below the best so far counts against the
    patience: a flat stretch (the smallest C values all predict the majority class; a
    plateau at the top) never stops the scan."""
    best, since = -np.inf, 0
    for i in range(n_heads):
        prev = st["heads"][i - 1] if i else None
        start = (None, None) if prev is None else (prev[0][None], prev[1][None])
        W, b, it, _cv = fit([i], *start, tol)
        st["heads"][i] = (W[0], b[0])
        st["n_it"][i] += int(it[0])
        st["val"][i] = v = _score(score, st, i, i - 1 if prev is not None and not it[0] else None)
        if v > best:
            best, since = v, 0
        elif v < best - margin:
            since += 1
        if patience is not None and since >= patience and i + 1 < n_heads:
            for j in range(i + 1, n_heads):
                st["status"][j] = PAST_PEAK
            log.debug("sweep scan stopped at C index %d, %d C values past the best", i, since)
            return list(range(i + 1))
    return list(range(n_heads))


def _score(score: Callable, st: dict, i: int, same_as: int | None) -> float:
    """Validation top-1 of head ``i``; a head that took 0 iterations from the head of
    ``same_as`` is that head (the solver returns its start unchanged): its score is copied."""
    if same_as is not None:
        return float(st["val"][same_as])
    return float(score([i], [st["heads"][i]])[0])


def _refine(fit, score, st, i: int, src: int, tol: float) -> int:
    """Fit C index ``i`` to ``tol`` from the head of ``src``; record its cost and score and
    return the iterations it took."""
    heads = st["heads"]
    W, b, it, cv = fit([i], heads[src][0][None], heads[src][1][None], tol)
    heads[i] = (W[0], b[0])
    st["n_it"][i] += int(it[0])
    st["conv"][i] = bool(cv[0])
    st["val"][i] = _score(score, st, i, src if src != i and not it[0] else None)
    st["status"][i] = KEPT
    return int(it[0])


def _climb(fit, score, st, p: int, tol: float, patience: int, margin: float) -> int:
    """Round 1: refine the scan's best ``p`` to ``tol``, then walk the path from it at
    ``tol``, each C from its refined neighbour: upwards while validation top-1 beats the
    best so far by more than ``margin`` (stopping after ``patience`` C values that do not),
    then, if nothing above ``p`` won, downwards while it stays within ``margin`` of the
    best. A C whose warm start already met ``tol`` (0 iterations: its neighbour's head) is
    no evidence and costs no patience. Returns the smallest refined C within ``margin`` of
    the best refined validation top-1."""
    n, val = len(st["heads"]), st["val"]
    _refine(fit, score, st, p, p, tol)
    done, top = [p], p
    for step in (1, -1):
        i, since = top, 0
        while since < patience and 0 <= i + step < n:
            moved = _refine(fit, score, st, i + step, i, tol)
            i += step
            done.append(i)
            best = max(val[j] for j in done)
            if (step > 0 and val[i] > val[top] + margin) or (step < 0 and val[i] >= best - margin):
                top, since = i, 0
            elif moved:
                since += 1
        if top != p:  # the side above won: below p is the losing side of a peak
            break
    best = max(val[j] for j in done)
    return min(j for j in done if val[j] >= best - margin)


def halving_sweep(
    fit: Callable,
    score: Callable,
    n_heads: int,
    *,
    tol: float,
    scan_tol: float,
    patience: int | None = 4,
    climb_patience: int = 2,
    margin: float = 1e-3,
) -> HalvingOutcome:
    """Scan, then climb from the scan's best, over heads ``0..n_heads-1`` (increasing C).

    ``fit(idx, W0, b0, tol)`` fits heads ``idx`` to tolerance ``tol`` (within the caller's
    ``max_iter``) from per-head starts (``W0 [h, D, K]``, ``b0 [h, K]``; ``None`` = the
    sweep's initial head) and returns ``(W, b, n_iter, converged)``; ``score(idx, heads)``
    returns validation top-1 per head. ``patience=None`` scans the whole grid. The
    selection is the smallest refined C within ``margin`` (default 0.1 point of top-1) of
    the best refined one: near the best C, heads converged to ``tol`` from different
    starting points differ by about that much on validation.
    """
    check_schedule(climb_patience, patience, scan_tol, tol)
    st = {
        "heads": [None] * n_heads,
        "n_it": np.zeros(n_heads, np.int64),
        "val": np.full(n_heads, np.nan),
        "conv": np.zeros(n_heads, bool),
        "status": [KEPT] * n_heads,
    }
    scanned = _scan(fit, score, n_heads, scan_tol, patience, st, margin)
    for i in scanned:
        st["status"][i] = SCANNED
    p = best_of(scanned, st["val"])
    rounds = [
        {"round": "scan", "tol": scan_tol, "fitted": len(scanned), "best": p, "head_iters": int(st["n_it"].sum())}
    ]
    best = _climb(fit, score, st, p, tol, climb_patience, margin)
    refined = [i for i, s in enumerate(st["status"]) if s == KEPT and st["heads"][i] is not None]
    rounds.append({"round": "climb", "tol": tol, "fitted": len(refined), "head_iters": int(st["n_it"].sum())})
    log.debug("sweep: scan best C index %d, climb refined %s, selected %d", p, refined, best)
    return HalvingOutcome(
        heads=st["heads"],
        n_iter=st["n_it"].tolist(),
        converged=st["conv"].tolist(),
        val=st["val"].tolist(),
        best_index=int(best),
        rounds=rounds,
        status=st["status"],
    )
