"""Out-of-core probe data: a split read in row blocks instead of one ``[N, D]`` float32 copy.

A :class:`RowSource` wraps the stored array (a float16 numpy array, a memmap or a zarr array
read chunk by chunk) with the standardisation statistics. Each block is converted to float64,
standardised and cast to float32 exactly as the in-memory path does for the whole array
(``((X - mean) / scale).astype(float32)``), so the streamed solver sees bit-identical feature
values; only the order of the float32 sums over rows differs. On a GPU the raw block moves to
device memory first and is standardised there.

Memory of a streamed fit: the stored array (or nothing, for a zarr array) plus one block of
``block_bytes`` plus the solver state (``2 * history + 4`` vectors of ``(D + 1) K`` float32 per
head iterating at once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import ProbeError

log = logging.getLogger(__name__)

#: above this estimated in-memory footprint the probes stream (see :func:`in_memory_bytes`)
DEFAULT_MAX_HOST_BYTES = 1 << 30
#: float32 working memory of one row block (features + logits of every active head)
DEFAULT_BLOCK_BYTES = 64 << 20
#: a stored chunk up to this size is decoded once per pass and cut into blocks
MAX_CHUNK_BYTES = 128 << 20


def in_memory_bytes(n: int, d: int, k: int, heads: int = 1) -> int:
    """Peak host bytes the in-memory fit allocates for ``n`` rows: the float32 features
    (``4d`` a row), the float64 temporaries of their standardisation (``X - mean`` and its
    quotient, alive together: ``16d``), the one-hot labels and the logits/probabilities of
    ``heads`` heads ([n, heads, K], twice). Counted as a sum although the temporaries are
    freed before the solver runs, so the bound errs towards streaming. Measured on
    40,000 x 512 float16 rows, 100 classes: the peak rose 10.3 kB a row (this: 11.4 kB)."""
    return 4 * int(n) * (5 * int(d) + int(k) * (1 + 2 * int(heads)))


def use_streaming(n: int, d: int, k: int, heads: int, max_host_bytes: int | None) -> bool:
    """Stream when the in-memory footprint exceeds ``max_host_bytes`` (None: the default)."""
    limit = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else int(max_host_bytes)
    return in_memory_bytes(n, d, k, heads) > limit


def state_heads(d: int, k: int, max_host_bytes: int | None, history: int = 10) -> int:
    """How many heads' L-BFGS state (``2 * history + 6`` vectors of ``(d + 1) k`` float32)
    fit in half of ``max_host_bytes``."""
    limit = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else int(max_host_bytes)
    return int(limit // 2 // (4 * (2 * history + 6) * (d + 1) * k))


def row_blocks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, max(1, int(rows))):
        yield s, min(n, s + rows)


def _rows_for(d: int, width: int, block_bytes: int) -> int:
    """Rows per block so the float32 block ([rows, d]) plus logits ([rows, width], x2) fit."""
    return int(np.clip(block_bytes // (4 * (d + 2 * width)), 64, 1 << 20))


def raw_blocks(X, rows: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(start, end, rows of X as stored)``, each stored chunk decoded once per pass.

    A chunked array (zarr) is read one stored chunk at a time (a chunk above
    :data:`MAX_CHUNK_BYTES` is read in blocks instead, so the decode buffer stays bounded)
    and cut into blocks of ``rows``; a numpy array yields views, no copy.
    """
    if hasattr(X, "iter_raw"):  # a StoredRows view gathers its rows chunk by chunk
        yield from X.iter_raw(rows)
        return
    n = X.shape[0]
    chunk = (getattr(X, "chunks", None) or (0,))[0]
    chunk_bytes = int(chunk) * int(np.prod(X.shape[1:])) * np.dtype(X.dtype).itemsize if chunk else 0
    unit = chunk if isinstance(chunk, int) and chunk > 0 and chunk_bytes <= MAX_CHUNK_BYTES else rows
    for s0, e0 in row_blocks(n, unit):
        raw = np.asarray(X[s0:e0])
        for s, e in row_blocks(e0 - s0, rows):
            yield s0 + s, s0 + e, raw[s:e]
        del raw


def nonfinite_rows(X, block_bytes: int | None = None) -> np.ndarray:
    """Mask of the rows of ``X`` holding NaN or inf, checked block by block (a lazily read
    array is never held whole); a store view whose load scanned it answers without a read."""
    known = X.known_nonfinite() if hasattr(X, "known_nonfinite") else None
    if known is not None:
        return known
    if isinstance(X, np.ndarray) and X.ndim > 2:  # [n, S, D] inputs (dinov2-linear), in memory
        return np.asarray(~np.isfinite(X.reshape(X.shape[0], -1)).all(axis=1))
    n, d = X.shape
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    bad = np.zeros(n, bool)
    for s, e, raw in raw_blocks(X, _rows_for(d, 0, block_bytes // 4)):
        bad[s:e] = ~np.isfinite(raw).all(axis=1)
    return bad


def check_finite_rows(X, block_bytes: int | None = None) -> None:
    """ProbeError naming the count of rows with NaN/inf, checked block by block."""
    bad = int(nonfinite_rows(X, block_bytes).sum())
    if bad:
        raise ProbeError(
            f"{bad} feature rows contain NaN or inf; drop them (rows with valid=False) or "
            "re-extract the features (`featcache verify` finds broken chunks)"
        )


def chunked_moments(X, block_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Column mean and (population) std of ``X`` in float64, one row block at a time.

    Blocks are merged with Chan et al.'s pairwise update, which is stable where the naive
    ``E[x^2] - E[x]^2`` loses digits; agrees with ``X.mean(0)``/``X.std(0)`` to ~1e-12 relative.
    """
    _n, d = X.shape
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    count, mean, m2 = 0, np.zeros(d), np.zeros(d)
    for s, e, raw in raw_blocks(X, _rows_for(2 * d, 0, block_bytes // 4)):  # float64: half the rows
        xb = np.asarray(raw, np.float64)
        nb = e - s
        mb = xb.mean(axis=0)
        xb -= mb  # in place: one float64 temporary per block
        m2b = np.einsum("ij,ij->j", xb, xb)
        delta = mb - mean
        tot = count + nb
        mean = mean + delta * (nb / tot)
        m2 = m2 + m2b + delta**2 * (count * nb / tot)
        count = tot
    return mean, np.sqrt(m2 / max(count, 1))


#: rows standardised per float64 step (a 1 MB-per-100-features temporary)
_STEP_ROWS = 512


def standardize_into(raw: np.ndarray, mean: np.ndarray, scale: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:m] = ((raw - mean) / scale).astype(float32)`` for ``m = len(raw)``, in float64
    steps of :data:`_STEP_ROWS` rows (bit-identical to the whole-array expression, without its
    ``[m, D]`` float64 temporary)."""
    m = raw.shape[0]
    tmp = np.empty((min(m, _STEP_ROWS), raw.shape[1]), np.float64)
    for s, e in row_blocks(m, _STEP_ROWS):
        t = tmp[: e - s]
        np.subtract(raw[s:e], mean, out=t)
        np.divide(t, scale, out=t)
        out[s:e] = t
    return out[:m]


@dataclass
class RowSource:
    """Standardised float32 row blocks of a stored ``[n, D]`` array on ``device``."""

    X: Any
    mean: np.ndarray  # float64 [D]
    scale: np.ndarray  # float64 [D]
    device: Any = "cpu"
    block_bytes: int | None = None  # None: DEFAULT_BLOCK_BYTES

    def __post_init__(self) -> None:
        import torch

        if self.block_bytes is None:
            self.block_bytes = DEFAULT_BLOCK_BYTES
        self.device = torch.device(self.device)
        self._on_gpu = self.device.type != "cpu"
        if self._on_gpu:
            self._mean_t = torch.as_tensor(self.mean, dtype=torch.float64, device=self.device)
            self._scale_t = torch.as_tensor(self.scale, dtype=torch.float64, device=self.device)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.X.shape)

    @property
    def dtype(self):
        import torch

        return torch.float32

    def blocks(self, width: int = 0):
        """Yield ``(start, end, block)``; ``width`` = logit columns the caller keeps per row.

        On the CPU every block is written into one reused float32 buffer: a block is valid
        until the next one is requested (the caller accumulates and drops it).
        """
        import torch

        n, d = self.shape
        rows = _rows_for(d, width, DEFAULT_BLOCK_BYTES if self.block_bytes is None else self.block_bytes)
        buf = None if self._on_gpu else np.empty((min(rows, n), d), np.float32)
        for s, e, raw in raw_blocks(self.X, rows):
            if self._on_gpu:  # the raw (float16) block goes to the device, standardised there
                xb = torch.from_numpy(np.ascontiguousarray(raw)).to(self.device, non_blocking=True)
                xb = ((xb.double() - self._mean_t) / self._scale_t).float()
            else:
                assert buf is not None  # allocated above for the CPU
                xb = torch.from_numpy(standardize_into(raw, self.mean, self.scale, buf))
            yield s, e, xb


def stream_loss_grad(src: RowSource, yidx, theta, lam, D: int, K: int, need_grad: bool = True):
    """:func:`featcache.probes._solver._loss_grad` accumulated over the row blocks of ``src``."""
    import torch

    h, (n, _) = theta.shape[0], src.shape
    dev, dt = theta.device, theta.dtype
    W = theta[:, : D * K].view(h, D, K)
    b = theta[:, D * K :]
    Wc = W.permute(1, 0, 2).reshape(D, h * K)
    loss = torch.zeros(h, dtype=torch.float64, device=dev)
    gW = torch.zeros(D, h * K, dtype=dt, device=dev) if need_grad else None
    gb = torch.zeros(h, K, dtype=dt, device=dev) if need_grad else None
    Zbuf = None  # the logits of every block, one reused [rows, h K] buffer
    for s, e, xb in src.blocks(h * K):
        nb = e - s
        if Zbuf is None or Zbuf.shape[0] < nb:
            Zbuf = torch.empty(nb, h * K, dtype=dt, device=dev)
        Z = torch.mm(xb, Wc, out=Zbuf[:nb]).view(nb, h, K)
        Z += b.unsqueeze(0)
        yb = yidx[s:e]
        zy = Z.gather(2, yb.view(nb, 1, 1).expand(nb, h, 1)).squeeze(2)
        m = Z.amax(dim=2, keepdim=True)
        E = Z.sub_(m).exp_()  # in place: exp(Z - m)
        S = E.sum(dim=2, keepdim=True)
        loss += ((m + torch.log(S)).squeeze(2) - zy).sum(dim=0, dtype=torch.float64)
        if gW is not None and gb is not None:  # need_grad
            E /= S
            E[torch.arange(nb, device=dev), :, yb] -= 1.0  # dL/dZ (times n)
            gW.addmm_(xb.T, E.reshape(nb, h * K))
            gb += E.sum(dim=0)
    loss = (loss / n).to(dt) + 0.5 * lam * (W * W).sum(dim=(1, 2))
    if gW is None or gb is None:  # not need_grad
        return loss, None
    gW = (gW / n).view(D, h, K).permute(1, 0, 2) + lam.view(h, 1, 1) * W
    return loss, torch.cat([gW.reshape(h, D * K), gb / n], dim=1)


def scores_blockwise(X, mean, scale, heads, y, block_bytes: int | None = None) -> list[float]:
    """Top-1 of each standardised-space head ``(W [D, K], b [K])`` on ``X``, by row block."""
    n, d = X.shape
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    hits = np.zeros(len(heads))
    width = max((W.shape[1] for W, _ in heads), default=0)
    rows = _rows_for(2 * d, width, block_bytes)
    buf = np.empty((min(rows, n), d), np.float32)
    for s, e, raw in raw_blocks(X, rows):
        xb = standardize_into(raw, mean, scale, buf).astype(np.float64)
        for i, (W, b) in enumerate(heads):
            hits[i] += np.sum((xb @ W + b).argmax(axis=1) == y[s:e])
    return [float(h / max(n, 1)) for h in hits]
