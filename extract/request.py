"""A store's settings are the store's: the request an extraction of one backbone x dataset was
started with (precision, feature kinds, input size, views, view seed) is recorded beside its
feature groups, and a later run with another request is refused in one line while anything of
the recorded one is written; before that, the new request replaces the old one (logged)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from featcache.errors import ProvenanceMismatchError

log = logging.getLogger(__name__)


def job_request(cfg: Any, amp: str, input_size: Any) -> dict[str, Any]:
    """What an extraction asks for, as recorded: the applied precision, kinds, side, views, seed."""
    return {
        "precision": {"none": "fp32"}.get(amp, amp),
        "features": ",".join(sorted(cfg.features)),
        "input_size": _side(input_size),
        "views": int(cfg.views),
        "view_seed": int(cfg.view_seed),
    }


def _side(input_size: Any) -> int | str:
    """The recorded side: N for a square input (as before HxW existed), else ``"HxW"``."""
    h, w = (int(s) for s in input_size[-2:])
    return w if h == w else f"{h}x{w}"


def differences(old: dict[str, Any], new: dict[str, Any], train: bool) -> list[str]:
    """The settings in which ``new`` departs from ``old``: views only where the job has the train
    split and asks for fewer but some (more views extend the stored ones; none re-runs train
    alone, byte-identical either way), the view seed only where both have views."""
    out = [k for k in ("precision", "features", "input_size") if k in old and old[k] != new[k]]
    if train and 0 < new["views"] < old.get("views", 0):  # no --views at all: train alone, as stored
        out.append("views")
    if train and new["views"] and old.get("views") and old.get("view_seed") != new["view_seed"]:
        out.append("view_seed")
    return out


def _flags(req: dict[str, Any], keys: list[str]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {req.get(k)}" for k in keys)


def _written(group: Any) -> bool:
    """Whether any feature group under ``features/<backbone>/<dataset>`` has a chunk marked done."""
    if group is None:
        return False
    for _, sg in group.groups():
        try:
            if "done" in sg and np.asarray(sg["done"][:]).any():
                return True
        except Exception:  # a damaged done array: count it as written (verify names it)
            return True
    return False


def check_request(store: Any, key: str, dataset: str, new: dict[str, Any], train: bool, overwrite: bool) -> bool:
    """Compare ``new`` with the recorded request of ``key`` x ``dataset`` and record it; refuse
    (one line naming both and the way out) a different one while anything of the recorded one is
    written. Returns True where the new request replaced an unwritten one (its empty groups are
    then rewritten)."""
    from featcache.store import StoreLock, read_request, write_request

    where = f"features/{key}/{dataset}"
    with StoreLock(store.root, where, timeout=600, what=where):
        old = read_request(store, key, dataset)
        if isinstance(old, dict) and not train:  # a job without train keeps the recorded views
            new = {**new, "views": old.get("views", 0), "view_seed": old.get("view_seed", 0)}
        was: dict[str, Any] = old if isinstance(old, dict) else {}  # diffs exist only beside a recorded one
        diffs = [] if overwrite or not isinstance(old, dict) else differences(old, new, train)
        replaced = bool(diffs) and not _written(store.root.get(where))
        if diffs and not replaced:
            raise ProvenanceMismatchError(
                f"{store.path}: {where} was extracted with {_flags(was, diffs)}, not {_flags(new, diffs)}; a resume "
                f"would mix them: re-run with {_flags(was, diffs)}, use another --backbone-name, or --overwrite "
                "to replace them"
            )
        if replaced:
            log.warning(
                "%s: nothing of the recorded request (%s) was written; it is replaced by this one (%s)",
                where, _flags(was, diffs), _flags(new, diffs),
            )  # fmt: skip
        if old is None and store.root.get(where) is not None:
            return False  # groups written before requests were recorded: their own checks apply
        if old != new:
            write_request(store, key, dataset, new)
    return replaced
