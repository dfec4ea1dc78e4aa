"""Row batching for the extraction: the map-style image dataset (never raises per image),
chunk-aligned batches, the collate step and the background chunk writer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

from featcache.data.source import SplitSource
from featcache.errors import DataError


class ImageRows:
    """Map-style dataset: row -> (row, image tensor, ok, error text). Never raises per image.

    With ``fast`` (:class:`~featcache.data.preprocess.FastPreprocess`) the image tensor is
    ``uint8 [H, W, 3]`` and the batch is normalised after stacking (:func:`collate` on CPU,
    on the device for CUDA); otherwise it is ``transform(img)``, float ``[C, H, W]``.
    """

    def __init__(self, source: SplitSource, transform, shape: tuple[int, int, int], fast=None):
        self.source = source
        self.transform = transform
        self.shape = shape
        self.fast = fast

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        import torch

        c, h, w = self.shape
        try:
            img = self.source.load(i)
            if self.fast is None:
                return i, self.transform(img), True, ""
            a = self.fast(img)
            if a.shape != (h, w, c):
                raise DataError(f"transform produced {a.shape[1]}x{a.shape[0]}x{a.shape[2]}, expected {w}x{h}x{c}")
            return i, torch.from_numpy(a), True, ""
        except Exception as exc:  # any decode/transform failure becomes an invalid row
            blank = torch.zeros(self.shape) if self.fast is None else torch.zeros((h, w, c), dtype=torch.uint8)
            return i, blank, False, f"{type(exc).__name__}: {exc}"[:500]


def collate(batch, channels_last: bool = False, fast=None):
    """Stack a batch (in the DataLoader worker). CPU forward: ``fast`` normalises the uint8
    batch here, and ``channels_last`` lays it out NHWC here, so the forward's cores do not
    spend time on either; for CUDA both happen on the GPU."""
    import torch

    rows = torch.tensor([b[0] for b in batch], dtype=torch.long)
    x = torch.stack([b[1] for b in batch])
    if fast is not None:
        x = fast.normalize(x, channels_last)
    elif channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    ok = torch.tensor([b[2] for b in batch], dtype=torch.bool)
    return rows, x, ok, [b[3] for b in batch]


def chunk_batches(chunks: Sequence[int], chunk_rows: int, n: int, batch_size: int) -> Iterator[list[int]]:
    """Batches of row indices, aligned to chunk starts (never crossing a chunk)."""
    for c in chunks:
        start, stop = c * chunk_rows, min((c + 1) * chunk_rows, n)
        for b in range(start, stop, batch_size):
            yield list(range(b, min(b + batch_size, stop)))


class BatchSampler:
    def __init__(self, chunks, chunk_rows, n, batch_size):
        self.args = (list(chunks), chunk_rows, n, batch_size)

    def __iter__(self):
        return chunk_batches(*self.args)

    def __len__(self):
        chunks, cr, n, bs = self.args
        return sum(-(-(min((c + 1) * cr, n) - c * cr) // bs) for c in chunks)


class BackgroundWriter:
    """Writes finished chunks on a thread so the model never waits on zarr."""

    def __init__(self, writer, enabled: bool = True, depth: int = 4):
        self.writer = writer
        self.enabled = enabled
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, name="featcache-writer", daemon=True)
        self.t.start()

    def _run(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None and self.enabled:
                try:
                    self.writer.write_chunk(*item)
                except BaseException as exc:  # surfaced in the main thread by put()/close()
                    self.error = exc

    def put(self, *item):
        if self.error:
            raise self.error
        self.q.put(item)

    def close(self):
        self.q.put(None)
        self.t.join()
        if self.error:
            raise self.error
