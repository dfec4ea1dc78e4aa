"""Fine-tuning data: a split's images in canonical order with labels in the train class
order, and the pool of images a run trains or evaluates on (preprocessed once into memory as
uint8 when it fits, else streamed through a DataLoader; normalised per batch)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.errors import DataError

if TYPE_CHECKING:
    import torch

    from featcache.data import SplitSource

__all__ = ["Pool", "Split", "prepare_split"]

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

    def load(self, pos: int) -> Any:
        return self.source.load(int(self.order[pos]))


def prepare_split(src: SplitSource, train_names: list[str]) -> Split:
    from featcache.core.stagerun import canonical_order, label_positions
    from featcache.store import dataset_fingerprint

    ids = np.asarray(src.ids).astype(str)
    order = canonical_order(ids)
    names = np.asarray(src.class_names, dtype=object)[np.asarray(src.labels)[order]]
    y = label_positions(names, train_names, f"{src.dataset}/{src.split}")
    fp = dataset_fingerprint(ids[order], y, train_names)
    return Split(src.split, src, order, y, ids[order], fp)


class _Rows:
    """Map-style torch dataset over (split, canonical position) pairs -> (image, label); the
    image is what ``transform`` makes of it (a ``uint8 [H, W, 3]`` array for the fast path)."""

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
            raise DataError(
                f"{sp.source.dataset}/{sp.name}: cannot load image {sp.ids[p]!r}: {exc}; "
                "fix or remove the file (extract records it as invalid)"
            ) from exc
        return self.transform(img), torch.tensor(int(sp.y[p]))


#: images per preprocessing batch (a uint8 batch at 224 px is 9.6 MB; no effect on numbers)
_PREPROCESS_BATCH = 64


class Pool:
    """Images a run trains or evaluates on, preprocessed once into memory when they fit in
    ``memory_limit`` bytes, else loaded through a DataLoader per batch.

    When the backbone's eval transform splits into a per-image ``uint8`` part and a batched
    normalisation (:func:`featcache.data.split_transform`, the extraction's fast path,
    bit-identical to the transform) the pool holds ``uint8 [N, H, W, 3]`` (a quarter of
    float32) and each batch is normalised when it is drawn; otherwise it holds the
    transform's float32 ``[N, C, H, W]``. ``nbytes`` is what the pool holds (0 when
    streaming).
    """

    def __init__(
        self,
        items: list[tuple[Split, int]],
        transform: Callable[[Any], Any],
        shape: Sequence[int],
        *,
        memory_limit: float,
        workers: int,
        progress: bool,
        what: str,
    ) -> None:
        from featcache.data import split_transform

        self.items = items
        self.fast = split_transform(transform)
        self.transform = self.fast if self.fast is not None else transform
        self.y = np.array([sp.y[p] for sp, p in items], np.int64)
        self.workers = workers
        c, h, w = (int(s) for s in shape)
        self.shape = (h, w, c) if self.fast is not None else (c, h, w)
        self.pixels = h * w
        need = len(items) * c * h * w * (1 if self.fast is not None else 4)
        self.X = None
        self.nbytes = 0
        if need <= memory_limit:
            self.X = self._materialise(progress, what)
            self.nbytes = need
        else:
            log.info(
                "%s: %d images (%.2f GB as %s) exceed memory_limit (%.2f GB left); loading per batch",
                what,
                len(items),
                need / 2**30,
                "uint8" if self.fast is not None else "float32",
                max(memory_limit, 0) / 2**30,
            )

    def _loader(self, batches):
        from torch.utils.data import DataLoader

        return DataLoader(
            _Rows(self.items, self.transform),  # pyright: ignore[reportArgumentType]  # a len/getitem object; torch says Dataset
            batch_sampler=batches,
            num_workers=self.workers,
            persistent_workers=False,
        )

    def _materialise(self, progress: bool, what: str):
        import torch

        from featcache.core.progress import tqdm

        dtype = torch.uint8 if self.fast is not None else torch.float32
        X = torch.empty((len(self.items), *self.shape), dtype=dtype)
        bs = _PREPROCESS_BATCH
        batches = [list(range(i, min(i + bs, len(self.items)))) for i in range(0, len(self.items), bs)]
        for b, (x, _) in zip(
            batches, tqdm(self._loader(batches), total=len(batches), desc=f"preprocess {what}", disable=not progress)
        ):
            X[b[0] : b[-1] + 1] = x
            del x  # the worker's shared-memory batch goes before the next one arrives
        return X

    def to(self, device: str) -> Pool:
        """Move preprocessed images to ``device`` (a GPU then gathers its own batches)."""
        if self.X is not None and device.startswith("cuda"):
            self.X = self.X.to(device)
        return self

    def _finish(self, x, device: str | None):
        """A drawn batch -> normalised float32 ``[B, C, H, W]`` on ``device`` (the uint8 batch
        travels, a GPU normalises it in channels-last layout; the CPU gets contiguous NCHW,
        the layout the transform gives)."""
        if device is not None:
            x = x.to(device, non_blocking=True)
        if self.fast is None:
            return x
        return self.fast.normalize(x, channels_last=x.device.type == "cuda")

    def batches(
        self, index_lists: Sequence[np.ndarray], device: str | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x, y) for each list of pool positions: x normalised float32 on ``device``
        (default: the pool's device when preprocessed, else the CPU), y int64 on the CPU."""
        import torch

        if self.X is not None:
            for idx in index_lists:
                t = torch.from_numpy(np.asarray(idx, np.int64)).to(self.X.device)
                yield self._finish(self.X[t], device), torch.from_numpy(self.y[np.asarray(idx)])
        else:
            for x, y in self._loader([list(map(int, i)) for i in index_lists]):
                yield self._finish(x, device), y
