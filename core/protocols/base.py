"""The protocol vocabulary: :class:`Protocol`, :class:`SplitPlan`, and the two registries every
protocol and split plan is registered in (:data:`PROTOCOLS` per stage, :data:`SPLIT_PLANS`),
with the functions that look them up. The built-in members live in
:mod:`~featcache.core.protocols.plans` and :mod:`~featcache.core.protocols.builtin`; a new one
is registered from its own module with :func:`register_protocol` / :func:`register_split_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.core.protocols.grids import Grid
from featcache.core.registry import Registry
from featcache.errors import ProtocolError, SplitError

__all__ = [
    "LAYER_SELECTIONS",
    "PROTOCOLS",
    "SPLIT_PLANS",
    "STAGES",
    "Protocol",
    "SplitPlan",
    "SplitRules",
    "get_protocol",
    "list_protocols",
    "list_split_plans",
    "pairs",
    "parse_protocol",
    "protocol_help",
    "protocol_usages",
    "register_fixed_protocol",
    "register_protocol",
    "register_split_plan",
    "split_rules",
]

STAGES = ("probe", "finetune", "dense")

#: how a layer sweep (``probe --layers``) picks its layer, named by :attr:`Protocol.layer_selection`:
#: each reads validation data the protocol already holds out, never an eval split
LAYER_SELECTIONS = {
    "val-score": "the validation score the protocol's own selection recorded (hparams val_<task metric>), "
    "mean over seeds",
    "val-split": "the task metric on the dataset's val split (--val-split), evaluated as one more split: "
    "for a protocol that holds out nothing (bob-linear)",
}


# ------------------------------------------------------------------ split plans
@dataclass
class SplitPlan:
    """Positions one seed trains on (``train``), selects on (``val``) and refits on
    (``final``). Positions index ``train ++ val``: ``i < n_train`` is train row ``i``,
    ``n_train + j`` is val row ``j``."""

    train: np.ndarray
    val: np.ndarray
    final: np.ndarray
    train_split: str  # the label recorded in result rows, e.g. "train[1000]", "train+val"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitRules:
    """What a split plan's registration records beside its planner (read without running it).

    ``val_split``: it selects on the dataset's own ``val`` split when the dataset has one;
    ``val_source``: the config's ``val_source`` chooses the validation rows (VTAB-1k:
    ``split-800-200`` takes them from train, ``official-val`` from the val split);
    ``auto_official_val``: ``val_source="auto"`` resolves to ``official-val`` wherever the
    store holds VTAB's ``val200`` or a val split (else ``split-800-200``)."""

    val_split: bool = True
    val_source: bool = False
    auto_official_val: bool = False


#: split-plan name -> planner ``fn(protocol, y, seed, n_val, val_source, train_name, val_name,
#: *, rows, val_rows, label_matrix=...) -> SplitPlan``; each entry's ``info`` is its :class:`SplitRules`
SPLIT_PLANS: Registry[Callable[..., SplitPlan]] = Registry("split plan", ProtocolError, idempotent=False)


def register_split_plan(
    name: str,
    target: Callable[..., SplitPlan] | str | None = None,
    *,
    val_split: bool = True,
    val_source: bool = False,
    auto_official_val: bool = False,
    note: str = "",
) -> Any:
    """Register a planner as split plan ``name`` (a decorator without ``target``; a ``str``
    target is ``module:attr``, imported on first use). The planner gets the protocol, the
    canonical labels ``y``, the seed, ``n_val`` (the val split's size or ``None``),
    ``val_source``, the split names and keywords ``rows``, ``val_rows`` (and ``label_matrix``
    when given), and returns a :class:`SplitPlan`; the flags are :class:`SplitRules`'."""
    rules = SplitRules(val_split, val_source, auto_official_val)
    return SPLIT_PLANS.register(name, target, note=note, info=rules)


def split_rules(name: str) -> SplitRules:
    """The :class:`SplitRules` of split plan ``name`` (unknown: :class:`ProtocolError`)."""
    return SPLIT_PLANS.entry(name).info


def list_split_plans() -> list[str]:
    """The registered split plans, in registration order."""
    return SPLIT_PLANS.names()


# ------------------------------------------------------------------ protocols
@dataclass(frozen=True)
class Protocol:
    """A named evaluation protocol (build with :func:`get_protocol`)."""

    spec: str  # canonical text recorded in result rows, e.g. "fewshot:5", "subset:10%"
    name: str  # registry name, e.g. "fewshot"
    stage: str  # "probe" or "finetune"
    split: str  # split plan: a name registered in SPLIT_PLANS
    solver: str  # "lbfgs" or "sgd"
    grid: Grid
    seeds: tuple[int, ...] = (0,)
    pairs_with: str | None = None  # the other stage's protocol with the same examples
    shots: int = -1  # examples per class, -1 = all
    fraction: float | None = None  # subset fraction
    median_over_seeds: bool = False  # report the median row (VTAB) beside each seed
    #: the plan takes its validation rows where the config's ``val_source`` says (VTAB-1k: 800/200
    #: of train or a val split); runs record the choice (run ids, hparams)
    val_source_choice: bool = False
    #: the order the plan takes its held-out rows in when not the canonical one (``"dataset"``:
    #: the dataset's own, as the ELEVATER toolkit does); runs record it in their run ids
    holdout_order: str | None = None
    #: the feature kind its runs read when the config leaves ``kind`` at ``pooled`` (the
    #: attentive probes: ``tokens``; a ``tokens@GxG`` kind named in the config is kept)
    kind: str | None = None
    #: how the analysis reduces its seeds (``how="auto"``): ``median`` (VTAB's rule, the
    #: default) or ``mean`` (ELEVATER's tables: mean +/- std over its three seeds)
    seed_rule: str = "median"
    #: how the analysis names its tasks after the dataset (``cifar10 (fewshot:5)``): ``None``
    #: the spec, ``""`` nothing (the default protocol), else this text (``zero-shot``)
    table_label: str | None = None
    #: how ``probe --layers`` selects the layer it reports: a key of :data:`LAYER_SELECTIONS`
    layer_selection: str = "val-score"

    def __post_init__(self) -> None:
        if self.split not in SPLIT_PLANS:
            raise ProtocolError(
                SPLIT_PLANS.unknown(self.split, what=f"protocol {self.spec!r} names unknown split plan")
            )
        if self.seed_rule not in ("median", "mean"):
            raise ProtocolError(f"protocol {self.spec!r}: seed_rule must be 'median' or 'mean', got {self.seed_rule!r}")
        if self.layer_selection not in LAYER_SELECTIONS:
            raise ProtocolError(
                f"protocol {self.spec!r}: layer_selection must be one of {list(LAYER_SELECTIONS)}, "
                f"got {self.layer_selection!r}"
            )

    @property
    def row_protocol(self) -> str:
        """The protocol name written to result rows: a fine-tune row carries the probe
        protocol it pairs with, so analysis matches them as one task."""
        return self.pairs_with if self.stage == "finetune" and self.pairs_with else self.spec

    @property
    def auto_official_val(self) -> bool:
        """Whether ``val_source="auto"`` selects on VTAB's val200 / the val split wherever the
        store holds it (its split plan's :class:`SplitRules`)."""
        return split_rules(self.split).auto_official_val

    def uses_val_split(self, val_source: str = "split-800-200") -> bool:
        """Whether the plan selects on the dataset's own ``val`` split when it has one."""
        rules = split_rules(self.split)
        return rules.val_split and not (rules.val_source and val_source == "split-800-200")

    def plan(
        self,
        y: ArrayLike,
        seed: int,
        *,
        n_val: int | None = None,
        val_source: str = "split-800-200",
        train_name: str = "train",
        val_name: str = "val",
        rows: ArrayLike | None = None,
        val_rows: ArrayLike | None = None,
        label_matrix: ArrayLike | None = None,
    ) -> SplitPlan:
        """The seeded split of labels ``y`` (canonical order). ``n_val``: size of the
        dataset's val split when the caller has one (``None``: no val split). ``rows`` /
        ``val_rows``: each canonical position's row in the dataset's own order (the store's
        and the reader's row order), used by the fixed ``vtab1k`` subsets; ``None``: the
        positions are already in that order. ``label_matrix``: the train split's [n, C] 0/1
        multi-label targets in the same order, when it has them (the ``elevater-*`` plans
        take their validation rows from it, as the toolkit does; the others split on ``y``)."""
        y = np.asarray(y)
        rows = np.arange(y.size) if rows is None else np.asarray(rows)
        if n_val is not None and val_rows is None:
            val_rows = np.arange(n_val)
        planner = SPLIT_PLANS.resolve(self.split)
        kw = {"rows": rows, "val_rows": val_rows}
        if label_matrix is not None:
            Y = np.asarray(label_matrix)
            if Y.ndim != 2 or Y.shape[0] != y.size:
                raise SplitError(f"label_matrix must be [{y.size}, C] like y; got shape {Y.shape}")
            kw["label_matrix"] = Y
        return planner(self, y, int(seed), n_val, val_source, train_name, val_name, **kw)


#: stage -> its protocols: ``fn(arg: str | None) -> Protocol`` by name, with usage and note
PROTOCOLS: dict[str, Registry[Callable[[str | None], Protocol]]] = {
    s: Registry(f"{s} protocol", ProtocolError, idempotent=False) for s in STAGES
}


def _registry(stage: str) -> Registry[Callable[[str | None], Protocol]]:
    if stage not in STAGES:
        raise ProtocolError(f"stage must be one of {STAGES}, got {stage!r}")
    return PROTOCOLS[stage]


def register_protocol(name: str, *, stage: str = "probe", usage: str | None = None, note: str = "") -> Callable:
    """Decorator: register ``fn(arg: str | None) -> Protocol`` as protocol ``name`` of
    ``stage``. ``arg`` is the text after ``name:`` in a spec (``None`` when absent).
    ``usage``: how the help and errors name it (default ``name``; a parametrised protocol
    says its argument, e.g. ``fewshot:N (N >= 2)``); ``note``: a short gloss in the help."""
    return _registry(stage).register(name, usage=usage, note=note)


def register_fixed_protocol(
    name: str, *, stage: str = "probe", note: str = "", doc: str = "", **fields: Any
) -> Callable[[str | None], Protocol]:
    """Register protocol ``name`` of ``stage`` that takes no argument: it builds
    ``Protocol(spec=name, name=name, stage=stage, **fields)`` (the name written once);
    ``note``: the help's gloss, ``doc``: the factory's docstring. Returns the factory."""

    def make(arg: str | None = None) -> Protocol:
        if arg is not None:
            raise ProtocolError(f"protocol {name!r} takes no argument, got {name}:{arg}")
        return Protocol(spec=name, name=name, stage=stage, **fields)

    make.__qualname__ = f"register_fixed_protocol({name!r}, stage={stage!r})"
    make.__doc__ = doc or f"The {stage} protocol {name!r}."
    return register_protocol(name, stage=stage, note=note)(make)


def list_protocols(stage: str = "probe") -> list[str]:
    """Registered protocol names of ``stage`` (parametrised ones without their argument)."""
    return sorted(_registry(stage))


def _parametrised(stage: str, name: str) -> bool:
    return PROTOCOLS[stage].entry(name).usage.startswith(f"{name}:")


def get_protocol(spec: str, stage: str = "probe") -> Protocol:
    """Build the protocol of ``spec`` (e.g. ``full``, ``fewshot:5``, ``subset:10%``)."""
    s = str(spec).strip().lower()
    name, sep, arg = s.partition(":")
    reg = _registry(stage)
    if name not in reg:
        word = "unknown fine-tuning protocol" if stage == "finetune" else "unknown protocol"
        raise ProtocolError(reg.unknown(name, spec=spec, what=word, known="choose one of"))
    return reg[name](arg if sep else None)


def parse_protocol(spec: str) -> Protocol:
    """A probe protocol by spec (``get_protocol(spec, "probe")``)."""
    return get_protocol(spec, "probe")


def pairs(stage: str = "finetune") -> dict[str, str | None]:
    """``{protocol of stage: the protocol of the other stage it pairs with}``."""
    return {n: get_protocol(n, stage).pairs_with for n in list_protocols(stage) if not _parametrised(stage, n)}


def protocol_usages(stage: str = "probe") -> list[str]:
    """How the help names each registered protocol of ``stage`` (``fewshot:N (N >= 2)``), in
    registration order."""
    return _registry(stage).usages()


def protocol_help(stage: str = "probe") -> str:
    """The ``--protocol`` help of ``stage``: every registered protocol's usage and note, in
    registration order, ``|``-separated (a fine-tune protocol also names its probe pair)."""
    out = []
    for e in _registry(stage).entries():
        note = e.note
        if stage == "finetune" and not _parametrised(stage, e.name) and get_protocol(e.name, stage).pairs_with:
            note = f"{note}; " * bool(note) + f"pairs with probe protocol {get_protocol(e.name, stage).pairs_with}"
        out.append(f"{e.usage} ({note})" if note else e.usage)
    return " | ".join(out)
