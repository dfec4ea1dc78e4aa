"""``featcache extract --views K``: the train split's seeded augmented views as feature groups.

View ``v`` of split ``train`` is extracted as split ``train@view{v}`` (same ids, labels and
row order as ``train``, every kind asked for), so each view has every store guarantee
(chunk checksums, resume, verify) and ``--views 8`` after ``--views 4`` finds views 0-3
complete and computes views 4-7 only. The transform is
:class:`~featcache.data.views.ViewTransform`; its spec, seed and index join the group's
recorded data config, so a resume with another ``--view-seed`` is refused, never mixed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from featcache.data.source import SplitSource
from featcache.data.views import ViewTransform, view_split
from featcache.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = ["VIEW_BASE_SPLIT", "ViewRows", "check_view_backbone", "check_view_splits", "with_views"]

#: the split augmented views are made of (evaluation splits keep the deterministic view)
VIEW_BASE_SPLIT = "train"


def check_view_backbone(bb: Any) -> None:
    """One-line refusal for a backbone whose preprocessing featcache does not build from a
    timm data config (open_clip, Hugging Face, torchvision weights: their library's own)."""
    if not all(k in bb.data_config for k in ("input_size", "mean", "std")):
        raise ConfigError(
            f"--views {bb.source}:{bb.name}: this source preprocesses with its library's own transform, so featcache "
            "cannot build its train augmentation (needs a timm data config: timm models, python:/module: models "
            "without their own transform); extract without --views"
        )


def with_views(
    sources: list[SplitSource], views: int, seed: int, bb: Any, limited: Callable[[SplitSource], SplitSource]
) -> list[SplitSource]:
    """``sources`` with ``views`` view splits of the train split after it (``limited``: the
    row limit applied to a source). Refused when no train split is extracted."""
    if not views:
        return sources
    check_view_backbone(bb)
    train = check_view_splits(sources, views)
    base = limited(train)
    out: list[SplitSource] = []
    for s in sources:
        out.append(s)
        if s is train:
            out += [
                dataclasses.replace(
                    base,
                    split=view_split(VIEW_BASE_SPLIT, v),
                    extra={**base.extra, "view": ViewTransform(bb.data_config, seed, v)},
                )
                for v in range(views)
            ]
    log.info("%d augmented view(s) of %s/%s, view seed %d", views, train.dataset, VIEW_BASE_SPLIT, seed)
    return out


def check_view_splits(sources: list[SplitSource], views: int) -> SplitSource:
    """The train split among ``sources``; one-line refusal when the job does not extract it."""
    train = next((s for s in sources if s.split == VIEW_BASE_SPLIT), None)
    if train is None:
        have = ", ".join(s.split for s in sources)
        raise ConfigError(
            f"--views {views} augments the {VIEW_BASE_SPLIT!r} split, which this job does not extract "
            f"(splits: {have}); add --split {VIEW_BASE_SPLIT}"
        )
    return train


class ViewRows:
    """Map-style dataset of one view: row -> (row, ``uint8 [H, W, 3]``, ok, error text), as
    :class:`~featcache.extract.batching.ImageRows` with ``fast``; never raises per image."""

    def __init__(self, source: SplitSource, view: ViewTransform, shape: tuple[int, int, int]):
        self.source = source
        self.view = view
        self.shape = shape

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        import torch

        c, h, w = self.shape
        try:
            a = self.view(self.source.load(i), i)
            if a.shape != (h, w, c):
                raise DataError(f"view produced {a.shape[1]}x{a.shape[0]}x{a.shape[2]}, expected {w}x{h}x{c}")
            return i, torch.from_numpy(a), True, ""
        except Exception as exc:  # any decode/transform failure becomes an invalid row
            return i, torch.zeros((h, w, c), dtype=torch.uint8), False, f"{type(exc).__name__}: {exc}"[:500]
