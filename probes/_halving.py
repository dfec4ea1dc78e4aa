"""Successive halving over a C grid on a warm-started regularisation path.

Round 0 runs every C for ``iter0`` L-BFGS iterations along the path (increasing C, each
head starting from its smaller-C neighbour's coefficients); each later round keeps the best
``1/eta`` of the surviving C values by validation top-1 (ties: smaller C), multiplies the
iteration budget by ``eta`` and continues each survivor from its own coefficients. Heads that
converge stop costing iterations but keep competing. It ends when one C is left and has
converged (or reached ``max_iter``), or when every survivor has converged.

The cost is counted in head-iterations (one head, one pass over the training rows per
iteration, plus line-search re-evaluations): strongly regularised heads converge within the
first rounds, so the long fits are spent on the few C values still competitive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class HalvingOutcome:
    heads: list  # standardised-space (W [D, K], b [K]) per C
    n_iter: list[int]
    converged: list[bool]
    val: list[float]  # last validation top-1 of each C (dropped C: at its last round)
    best_index: int
    rounds: list[dict] = field(default_factory=list)

    @property
    def head_iters(self) -> int:
        return int(sum(self.n_iter))


def _keep(alive: list[int], val: np.ndarray, eta: int) -> list[int]:
    order = sorted(alive, key=lambda i: (-val[i], i))  # best first; ties: smaller C
    return sorted(order[: max(1, -(-len(alive) // eta))])


def halving_sweep(
    fit: Callable, score: Callable, n_heads: int, *, max_iter: int, iter0: int = 10, eta: int = 3
) -> HalvingOutcome:
    """Successive halving over heads ``0..n_heads-1`` (sorted by increasing C).

    ``fit(idx, W0, b0, iters)`` fits heads ``idx`` for at most ``iters`` iterations from
    per-head starts (``W0 [h, D, K]``, ``b0 [h, K]``; ``None`` = the path warm start) and
    returns ``(W, b, n_iter, converged)``; ``score(idx, heads)`` returns validation top-1.
    """
    if iter0 < 1 or eta < 2:
        raise ValueError(f"halving needs iter0 >= 1 and eta >= 2 (got {iter0}, {eta})")
    heads: list = [None] * n_heads
    n_it = np.zeros(n_heads, np.int64)
    conv = np.zeros(n_heads, bool)
    val = np.full(n_heads, -1.0)
    alive, target, rounds = list(range(n_heads)), min(iter0, max_iter), []
    while True:
        run = [i for i in alive if not conv[i] and n_it[i] < target]
        if run:
            start = (
                None
                if heads[run[0]] is None
                else (np.stack([heads[i][0] for i in run]), np.stack([heads[i][1] for i in run]))
            )
            W, b, it, cv = fit(run, *(start or (None, None)), int(target - n_it[run].max()))
            for j, i in enumerate(run):
                heads[i] = (W[j], b[j])
                n_it[i] += int(it[j])
                conv[i] = bool(cv[j])
        val[alive] = score(alive, [heads[i] for i in alive])
        rounds.append({"target": int(target), "alive": len(alive), "ran": len(run)})
        log.debug("halving round %d: %d alive, %d fitted to %d iterations", len(rounds), len(alive), len(run), target)
        if conv[alive].all() or target >= max_iter:
            break
        if len(alive) > 1:
            alive = _keep(alive, val, eta)
        target = min(max_iter, target * eta)
    best = min(alive, key=lambda i: (-val[i], i))
    return HalvingOutcome(
        heads=heads,
        n_iter=n_it.tolist(),
        converged=conv.tolist(),
        val=val.tolist(),
        best_index=int(best),
        rounds=rounds,
    )
