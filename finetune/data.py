"""Fine-tuning data: a split's images in canonical order with labels in the train class
order, and the pool of images a run trains or evaluates on (preprocessed once into memory
when it fits, else streamed through a DataLoader)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import DataError

__all__ = ["Split", "Pool", "prepare_split"]

log = logging.getLogger(__name__)


@dataclass
class Split:
    """Rows of one split in canonical (id-sorted) order, labels in the train class order."""

    name: str
    source: Any  # SplitSource
    order: np.ndarray  # canonical position -> source row
    y: np.ndarray
    ids: np.ndarray
    fingerprint: str

    def load(self, pos: int):
        return self.source.load(int(self.order[pos]))


def prepare_split(src, train_names: list[str]) -> Split:
    from featcache.splits import canonical_order
    from featcache.store import dataset_fingerprint

    ids = np.asarray(src.ids).astype(str)
    order = canonical_order(ids)
    names = np.asarray(src.class_names, dtype=object)[np.asarray(src.labels)[order]]
    pos = {n: i for i, n in enumerate(train_names)}
    unknown = sorted({str(n) for n in names if n not in pos})
    if unknown:
        raise DataError(f"{src.dataset}/{src.split} has classes {unknown[:10]} that the train split "
                        "does not define; give splits with the same class list")
    y = np.fromiter((pos[n] for n in names), np.int64, count=names.size)
    fp = dataset_fingerprint(ids[order], y, train_names)
    return Split(src.split, src, order, y, ids[order], fp)


class _Rows:
    """Map-style torch dataset over (split, canonical position) pairs -> (image tensor, label)."""

    def __init__(self, items: list[tuple[Split, int]], transform):
        self.items = items
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        import torch

        sp, p = self.items[i]
        try:
            img = sp.load(p)
        except Exception as exc:  # a broken file: name it, never train on a placeholder
            raise DataError(f"{sp.source.dataset}/{sp.name}: cannot load image {sp.ids[p]!r}: {exc}; "
                            "fix or remove the file (extract records it as invalid)") from exc
        return self.transform(img), torch.tensor(int(sp.y[p]))


class Pool:
    """Images a run trains or evaluates on, preprocessed once into a tensor when they fit in
    ``memory_limit`` bytes (float32), else loaded through a DataLoader per batch."""

    def __init__(self, items: list[tuple[Split, int]], transform, shape, *, memory_limit: float,
                 workers: int, progress: bool, what: str):
        self.items = items
        self.transform = transform
        self.y = np.array([sp.y[p] for sp, p in items], np.int64)
        self.workers = workers
        nbytes = len(items) * int(np.prod(shape)) * 4
        self.X = None
        if nbytes <= memory_limit:
            self.X = self._materialise(shape, progress, what)
        else:
            log.info("%s: %d images (%.1f GB as float32) exceed memory_limit; loading per batch",
                     what, len(items), nbytes / 1e9)

    def _loader(self, batches):
        from torch.utils.data import DataLoader

        return DataLoader(_Rows(self.items, self.transform), batch_sampler=batches,
                          num_workers=self.workers, persistent_workers=False)

    def _materialise(self, shape, progress: bool, what: str):
        import torch
        from tqdm.auto import tqdm

        X = torch.empty((len(self.items), *shape), dtype=torch.float32)
        bs = 256
        batches = [list(range(i, min(i + bs, len(self.items)))) for i in range(0, len(self.items), bs)]
        for b, (x, _) in zip(batches, tqdm(self._loader(batches), total=len(batches),
                                            desc=f"preprocess {what}", disable=not progress)):
            X[b[0] : b[-1] + 1] = x
        return X

    def to(self, device: str) -> Pool:
        """Move preprocessed images to ``device`` (a GPU then gathers its own batches)."""
        if self.X is not None and device.startswith("cuda"):
            self.X = self.X.to(device)
        return self

    def batches(self, index_lists: Sequence[np.ndarray]):
        """Yield (x, y) tensors for each list of pool positions (on the pool's device when
        preprocessed, else on CPU from the DataLoader)."""
        import torch

        if self.X is not None:
            for idx in index_lists:
                t = torch.from_numpy(np.asarray(idx, np.int64)).to(self.X.device)
                yield self.X[t], torch.from_numpy(self.y[np.asarray(idx)])
        else:
            yield from self._loader([list(map(int, i)) for i in index_lists])
