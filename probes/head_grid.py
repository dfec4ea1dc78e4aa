"""Head grids trained rung by rung: the full grid or successive halving, within a memory bound.

``attentive:*`` and ``dinov2-linear`` train a grid of heads (lr x wd, or n_blocks x avgpool x
lr) on the same batches and pick the best on validation. This module schedules that work:

* **Schedule** (``--grid-schedule``). ``full`` (the default: V-JEPA's and DINOv2's recipes
  train every head to the end) is one rung at the last step. ``halving`` is successive
  halving: rungs end at ``T / eta^k`` steps (k = R..1, R = floor(log_eta(heads)), T every
  step of the run), then T; at the end of each rung but the last every head still training
  is scored on the validation rows (never test) and the best ``ceil(alive / eta)`` continue
  (ties: the earlier head of the grid). A survivor continues with its own lr / wd schedule,
  still defined over all T steps, on the same batches: its trajectory is the full grid's run
  of that head. ``eta`` (``--halving-eta``, default 3, as Hyperband / ASHA) keeps a third at
  each rung: the 20-head attentive grid trains 20 heads for T/9, 7 to T/3 and 3 to T, 0.29x
  the full grid's head-steps; eta 2 costs 0.21x but its first cut comes after T/16.
* **Memory bound** (``--max-memory``). Each head's parameters, gradients and optimiser state
  (and an estimate of its activations at the batch size) are computed before training; when
  the heads still training do not fit beside the shared buffers, they are trained in groups,
  one after the other, each group on the same batches in the same order, so a head's
  trajectory does not depend on its group. Paused heads (halving with several groups) wait
  in a temporary directory, not in memory.

Cost is counted in head-steps (one head, one optimisation step on one batch), the unit
that scales with the grid's training compute.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from featcache.core.configs import Interval, OneOf, flag
from featcache.errors import FeatcacheError, ProbeError

log = logging.getLogger(__name__)

__all__ = [
    "GRID_SCHEDULES",
    "GridCallbacks",
    "GridOutcome",
    "GridPlan",
    "Rung",
    "grid_rungs",
    "grid_schedule_option",
    "halving_eta_option",
    "head_groups",
    "head_steps",
    "max_memory_option",
    "memory_line",
    "run_grid",
    "survivors",
]

GRID_SCHEDULES = ("full", "halving")
#: the default halving rate: a third of the heads continue at each rung (Hyperband's eta)
DEFAULT_ETA = 3
KEPT = "trained to the end"


def grid_schedule_option() -> Any:
    """The ``--grid-schedule`` field shared by the head-grid solvers."""
    return flag(
        "full",
        "attentive:*, dinov2-linear: train every head of the grid to the end (full, the recipes') or "
        "successive halving (every head for a first budget, the worst dropped on val at each rung)",
        check=OneOf(*GRID_SCHEDULES),
    )


def halving_eta_option() -> Any:
    """The ``--halving-eta`` field: 1 / the fraction of heads kept at each rung."""
    return flag(
        DEFAULT_ETA, "--grid-schedule halving: keep 1/ETA of the heads at each rung", type=int, check=Interval(int, 2)
    )


class _MemorySize:
    """The ``--max-memory`` check: ``None`` or a size :func:`~featcache.core.memory.parse_memory` reads."""

    def __call__(self, value: Any) -> str | None:
        from featcache.core.memory import parse_memory

        if value is None:
            return None
        try:
            parse_memory(value)
        except FeatcacheError as e:  # its text names the value: keep what follows
            return str(e).split(" is ", 1)[-1].removeprefix("invalid: ")
        return None

    @staticmethod
    def shown(value: Any) -> str:
        return repr(value)


def max_memory_option() -> Any:
    """The ``--max-memory`` field of the head-grid solvers (a size: 2GB, 512MB, 1e9)."""
    return flag(
        None,
        "attentive:*, dinov2-linear: bound on the grid's parameters, optimiser state and activations; "
        "heads are trained in groups within it (the same results); e.g. 2GB",
        type=str,
        check=_MemorySize(),
    )


@dataclass(frozen=True)
class GridPlan:
    """How a head grid is run: ``schedule`` (``full`` / ``halving``), ``eta``, the memory
    bound in bytes (``None``: none), a progress bar or not, and the name logged (the spec)."""

    schedule: str = "full"
    eta: int = DEFAULT_ETA
    max_memory: int | None = None
    progress: bool = True
    what: str = "head grid"

    @classmethod
    def from_opts(cls, opts: dict[str, Any], what: str) -> GridPlan:
        """The plan from a solver's resolved options (``--grid-schedule``, ``--halving-eta``,
        ``--max-memory``, ``progress``)."""
        from featcache.core.memory import parse_memory

        mm = opts.get("max_memory")
        return cls(
            str(opts.get("grid_schedule") or "full"),
            int(opts.get("halving_eta") or DEFAULT_ETA),
            None if mm is None else parse_memory(mm, error=ProbeError),
            bool(opts.get("progress", True)),
            what,
        )

    def record(self, out: GridOutcome) -> dict[str, Any]:
        """The hparams of a non-default plan (the full grid in one group records nothing new)."""
        hp: dict[str, Any] = {}
        if self.schedule != "full":
            hp.update(
                grid_schedule=self.schedule,
                halving_eta=self.eta,
                grid_head_steps=out.head_steps,
                grid_full_head_steps=out.full_head_steps,
                grid_compute_ratio=round(out.compute_ratio, 4),
                grid_rungs=out.rungs,
            )
        if out.groups > 1:
            hp["grid_groups"] = out.groups
        return hp


@dataclass(frozen=True)
class Rung:
    """A rung ends after step ``end`` (1-based steps); ``keep`` heads continue past it."""

    end: int
    keep: int


def grid_rungs(schedule: str, n_heads: int, total_steps: int, eta: int = DEFAULT_ETA) -> list[Rung]:
    """The rungs of ``schedule`` over ``n_heads`` heads and ``total_steps`` steps (see the module)."""
    if schedule == "full" or n_heads <= 1:
        return [Rung(total_steps, n_heads)]
    if schedule != "halving":
        raise ProbeError(f"grid schedule must be one of {GRID_SCHEDULES}, got {schedule!r}")
    if eta < 2:
        raise ProbeError(f"halving_eta must be >= 2 (got {eta}): the heads kept at each rung are 1/eta")
    R = 0
    while eta ** (R + 1) <= n_heads:
        R += 1
    rungs, alive = [], n_heads
    for k in range(R, 0, -1):
        end = max(1, round(total_steps / eta**k))
        if end >= total_steps or (rungs and end <= rungs[-1].end):
            continue
        alive = math.ceil(alive / eta)
        rungs.append(Rung(end, alive))
    return [*rungs, Rung(total_steps, alive)]


def head_steps(n_heads: int, rungs: Sequence[Rung]) -> int:
    """Head-steps of a schedule: each rung's steps times the heads training in it."""
    out, start, alive = 0, 0, n_heads
    for r in rungs:
        out += alive * (r.end - start)
        start, alive = r.end, r.keep
    return out


def survivors(alive: Sequence[int], scores: dict[int, float], keep: int) -> list[int]:
    """The ``keep`` best of ``alive`` by validation score (ties: the earlier head), in grid order."""
    ranked = sorted(alive, key=lambda i: (-_finite(scores[i]), i))
    return sorted(ranked[:keep])


def _finite(v: float | None) -> float:
    """A score to rank by: NaN, +inf and ``None`` (not finite, as recorded) rank last."""
    return v if v is not None and v == v and v != math.inf else -math.inf


def head_groups(heads: Sequence[int], per_head: int, shared: int, bound: int | None, what: str) -> list[list[int]]:
    """``heads`` cut into groups that fit ``bound`` bytes beside ``shared`` (``None``: one group).
    ProbeError, saying what to do, when not even one head fits."""
    heads = list(heads)
    if bound is None or not heads:
        return [heads]
    size = (bound - shared) // max(1, per_head)
    if size < 1:
        need = per_head + shared
        raise ProbeError(
            f"{what}: one head's parameters, gradients and optimiser state need {_gb(per_head)} beside "
            f"{_gb(shared)} of shared buffers (batches, activations), above --max-memory {_gb(bound)}; "
            "raise --max-memory to at least "
            f"{_gb(need)}, or probe narrower features (fewer tokens, e.g. --kind tokens@2x2)"
        )
    return [heads[i : i + size] for i in range(0, len(heads), size)]


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def memory_line(
    what: str, n_heads: int, params: int, state_bytes: int, shared: int, bound: int | None, groups: int
) -> str:
    """The line logged before training: the grid's parameter and optimiser memory, the shared
    buffers and the bound."""
    bound_s = "no --max-memory bound" if bound is None else f"--max-memory {_gb(bound)}"
    how = "one group" if groups <= 1 else f"{groups} groups of heads, one after the other"
    return (
        f"{what}: {n_heads} heads x {params / 1e6:.2f}M parameters; parameters + gradients + optimiser state "
        f"{_gb(n_heads * state_bytes)}, shared buffers {_gb(shared)}; {bound_s}: {how}"
    )


@dataclass
class GridOutcome:
    """What :func:`run_grid` did: each head's last validation score (``nan``: never scored),
    its status, the best surviving head, the head-steps spent and the full grid's."""

    val: list[float]
    status: list[str]
    best: int
    head_steps: int
    full_head_steps: int
    rungs: list[dict] = field(default_factory=list)
    kept: dict[int, Any] = field(default_factory=dict)
    groups: int = 1

    @property
    def compute_ratio(self) -> float:
        return self.head_steps / max(1, self.full_head_steps)


@dataclass
class GridCallbacks:
    """The solver's side of :func:`run_grid`. ``init(idx)``: fresh states of heads ``idx`` (each
    head's own, drawn as in the one-group run); ``train(states, idx, s0, s1)``: steps
    ``s0+1..s1`` of those heads, in place; ``score(states, idx)``: their validation scores;
    ``dump(state)`` / ``load(i, obj)``: a state to and from ``torch.save``-able tensors;
    ``take(state)``: what the caller keeps of a finished head (e.g. its weights); ``alive(k)``:
    told the number of heads still training at the start of each rung (the progress bar)."""

    init: Callable[[list[int]], list[Any]]
    train: Callable[[list[Any], list[int], int, int], None]
    score: Callable[[list[Any], list[int]], list[float]]
    dump: Callable[[Any], Any]
    load: Callable[[int, Any], Any]
    take: Callable[[Any], Any]
    alive: Callable[[int], None] | None = None


def run_grid(
    n_heads: int, rungs: Sequence[Rung], group_size: int, cb: GridCallbacks, keep: str = "best"
) -> GridOutcome:
    """Train heads ``0..n_heads-1`` rung by rung (see the module), ``group_size`` at a time.
    ``keep``: ``best`` keeps only the selected head's ``take``, ``all`` every finished head's."""
    import torch

    alive, start = list(range(n_heads)), 0
    val, status = [math.nan] * n_heads, [KEPT] * n_heads
    mem: dict[int, Any] = {}
    spilled: dict[int, str] = {}
    kept: dict[int, Any] = {}
    out_rungs, groups_max, last = [], 1, len(rungs) - 1
    with tempfile.TemporaryDirectory(prefix="featcache-heads-") as tmp:
        for r_i, rung in enumerate(rungs):
            groups = [alive[i : i + group_size] for i in range(0, len(alive), group_size)]
            if cb.alive is not None:
                cb.alive(len(alive))
            groups_max = max(groups_max, len(groups))
            for g in groups:
                states = _states(g, mem, spilled, cb, start == 0)
                cb.train(states, g, start, rung.end)
                for i, v in zip(g, cb.score(states, g)):
                    val[i] = float(v)
                if r_i == last:
                    for i, st in zip(g, states):
                        kept[i] = cb.take(st)
                    _trim(kept, val, keep)
                elif len(groups) > 1:
                    for i, st in zip(g, states):
                        spilled[i] = os.path.join(tmp, f"head{i}.pt")
                        torch.save(cb.dump(st), spilled[i])
                else:
                    mem.update(zip(g, states))
                del states
            nxt = survivors(alive, dict(enumerate(val)), rung.keep) if r_i < last else alive
            for i in set(alive) - set(nxt):
                status[i] = f"dropped at rung {r_i + 1} (step {rung.end}, val {val[i]:.4g})"
                mem.pop(i, None)
                if i in spilled:
                    os.remove(spilled.pop(i))
            out_rungs.append(
                {"rung": r_i + 1, "end_step": rung.end, "heads": len(alive), "groups": len(groups),
                 "val": {i: val[i] if math.isfinite(val[i]) else None for i in alive}, "kept": list(nxt)}
            )  # fmt: skip
            alive, start = nxt, rung.end
    best = survivors(alive, dict(enumerate(val)), 1)[0]
    return GridOutcome(
        val, status, best, head_steps(n_heads, rungs), n_heads * rungs[-1].end, out_rungs, kept, groups_max
    )


def _states(g: list[int], mem: dict, spilled: dict, cb: GridCallbacks, fresh: bool) -> list[Any]:
    """The states of group ``g``: fresh at the first rung, else from memory or the spill."""
    import torch

    if fresh:
        return cb.init(g)
    out = []
    for i in g:
        if i in mem:
            out.append(mem.pop(i))
        else:
            path = spilled.pop(i)
            out.append(cb.load(i, torch.load(path, weights_only=False)))
            os.remove(path)
    return out


def _trim(kept: dict, val: list[float], keep: str) -> None:
    """With ``keep == "best"``, only the best finished head so far stays in ``kept``."""
    if keep == "best" and len(kept) > 1:
        best = survivors(list(kept), dict(enumerate(val)), 1)[0]
        for i in [i for i in kept if i != best]:
            del kept[i]
