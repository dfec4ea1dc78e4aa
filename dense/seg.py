"""The ``seg-linear`` dense solver: a linear segmentation head on stored patch-token grids, as
facebookresearch/dinov3 trains and evaluates it (``dinov3/eval/segmentation/``, commit 6876159):

- the head (``models/heads/linear_head.py``): Dropout2d(0.1), BatchNorm (SyncBatchNorm in the
  reference: one process here, so ``BatchNorm2d`` with torch's defaults eps 1e-5, momentum 0.1),
  a 1x1 conv initialised N(0, 0.01), bias 0; DINOv2's ``BNHead`` (``seg-linear:dinov2``) is
  the same without the dropout; blocks concatenated on channels (``seg-linear:dinov2-ms``);
- training (``train.py``): logits bilinear (``align_corners=False``) to the label size,
  cross-entropy with ignore index 255 summed over pixels and divided by every pixel, ignored
  ones included (``loss.py`` ``CrossEntropyLoss``, ``avg_non_ignore=False``); AdamW lr 1e-3, wd
  1e-3, betas (0.9, 0.999); ``WarmupOneCycleLR`` (:func:`warmup_one_cycle_lr`), its length
  scaled to the cached rows (the warm-up its reference fraction, 1500 / 40000);
- evaluation (``inference.py`` ``slide_inference``): each window's logits bilinear to the
  window, summed into the resized image and divided by the count map, bilinear to the original
  size, argmax, scored by :class:`~featcache.core.dense_metrics.SegmentationAccumulator` against
  the original-resolution mask; without stored windows, the resize rows against their mask.

Selection: the reference reports the best of its periodic validations (every 5000 of 40000
iterations); featcache validates at the same fractions of its schedule on the selection split
and reports the test split at the checkpoint that scored best there (never the best of test).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.dense import DenseRows
from featcache.core.dense_metrics import IGNORE_INDEX, SegmentationAccumulator
from featcache.dense.solvers import DenseEval, DenseFit, DenseTask
from featcache.errors import DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = [
    "WindowStitcher",
    "evaluate",
    "fit_seg_linear",
    "make_seg_head",
    "schedule_length",
    "tokens_to_grid",
    "update_lr",
    "warmup_one_cycle_lr",
]

#: the reference validates every 5000 of its 40000 iterations (config-ade20k-linear-training.yaml)
VAL_CHECKS = 8


def warmup_one_cycle_lr(step: int, total: int, max_lr: float, warmup_iters: int, warmup_ratio: float) -> float:
    """The lr of optimizer step ``step`` (0-based) under DINOv3's ``WarmupOneCycleLR`` as its
    segmentation config builds it (pct_start 0, final_div_factor inf, cosine): a linear warm-up
    from ``max_lr * warmup_ratio`` damped by ``1 - step / total``, then a cosine from ``max_lr``
    to 0 evaluated at ``step + 1`` (``schedulers.py`` ``_compute_lr_momentum``)."""
    if step < warmup_iters:
        if warmup_ratio:
            k = (1 - step / warmup_iters) * (1 - warmup_ratio)
            return max_lr * (1 - k) * (1 - step / total)
        gmax = max_lr * (1 + math.cos(math.pi * step / float(total))) / 2
        return gmax * step / float(warmup_iters)  # max_lr / inf = 0
    pct = (step + 1) / float(total)
    return max_lr / 2.0 * (math.cos(math.pi * pct) + 1)  # min_lr = initial_lr / inf = 0


def update_lr(update: int, total: int, max_lr: float, warmup_iters: int, warmup_ratio: float) -> float:
    """The lr of head update ``update`` (0-based) in DINOv3's training loop: its ``train_step``
    steps the scheduler only after updates ``> 0`` ("inheritance from old mmcv code",
    ``train.py``), so updates 0 and 1 both run at the schedule's step 0, update ``g`` at step
    ``g - 1``."""
    return warmup_one_cycle_lr(max(update - 1, 0), total, max_lr, warmup_iters, warmup_ratio)


def schedule_length(grid: Any, n_rows: int, cfg: Any) -> tuple[int, int, int]:
    """``(iterations, warmup_iters, batch_size)``: ``cfg.iterations``, else ``epochs`` passes
    (the config's or the grid's) over ``n_rows`` training rows; the warm-up the reference's
    fraction of it (1500 / 40000)."""
    bs = int(cfg.batch_size or grid.batch_size)
    epochs = cfg.epochs if cfg.epochs is not None else grid.epochs
    iters = int(cfg.iterations or max(1, math.ceil(epochs * n_rows / bs)))
    warm = round(iters * grid.warmup_iters / grid.reference_iters)
    return iters, warm, bs


def _torch_head_class() -> type:
    from torch import nn

    class _Head(nn.Module):
        def __init__(self, channels: int, n_classes: int, dropout: float) -> None:
            super().__init__()
            self.channels, self.n_classes = channels, n_classes
            self.batchnorm_layer = nn.BatchNorm2d(channels)
            self.conv = nn.Conv2d(channels, n_classes, kernel_size=1, padding=0, stride=1)
            self.dropout = nn.Dropout2d(dropout) if dropout > 0 else nn.Identity()
            nn.init.normal_(self.conv.weight, mean=0, std=0.01)
            nn.init.constant_(self.conv.bias, 0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(self.batchnorm_layer(self.dropout(x)))

        def predict(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(self.batchnorm_layer(x))

    return _Head


def make_seg_head(channels: int, n_classes: int, dropout: float = 0.1) -> torch.nn.Module:
    """The linear head on ``[B, channels, gh, gw]`` grids: ``forward`` (training: Dropout2d,
    BatchNorm, 1x1 conv), ``predict`` (no dropout), as DINOv3's ``LinearHead`` orders them
    (``dropout=0``: DINOv2's ``BNHead``). Build it under ``torch.manual_seed`` for a seeded init."""
    return _torch_head_class()(channels, n_classes, dropout)


def tokens_to_grid(blocks: list[np.ndarray], grid: tuple[int, int]) -> np.ndarray:
    """``[B, gh*gw, D]`` token rows of each block (row-major over gh) as one ``[B, sum D, gh, gw]``
    float32 array, blocks concatenated on channels (DINOv3's ``_transform_inputs``)."""
    gh, gw = grid
    out = []
    for t in blocks:
        t = np.asarray(t, np.float32)
        if t.ndim != 3 or t.shape[1] != gh * gw:
            raise DataError(
                f"token rows of shape {tuple(t.shape)} do not hold the recorded {gh}x{gw} grid; "
                "re-extract the tokens (featcache extract --features tokens)"
            )
        out.append(t.reshape(t.shape[0], gh, gw, t.shape[2]).transpose(0, 3, 1, 2))
    return np.concatenate(out, axis=1)


class _Batches:
    """Seeded training batches over the rows of every training group: row blocks (bounded by
    the memory budget) visited in a seeded order, rows shuffled within a block; every row of an
    epoch seen once. When every row fits in the budget, each block is read once and kept. ``torch`` tensors of ``[B, C, gh, gw]`` grids and ``[B, H, W]`` labels."""

    def __init__(self, groups: list[DenseRows], kinds: tuple[str, ...], budget: int, seed: int) -> None:
        self.groups, self.kinds = groups, kinds
        self.rng = np.random.default_rng(seed)
        g0 = groups[0]
        row_bytes = sum(int(np.prod(g0.kinds[k].shape[1:])) * 4 for k in kinds) + int(np.prod(g0.target.shape[1:]))
        self.block_rows = max(1, int(budget // max(1, row_bytes)))
        self.valid = [np.flatnonzero(np.asarray(g.valid, bool)) for g in groups]
        self.n_rows = int(sum(v.size for v in self.valid))
        if not self.n_rows:
            raise DataError("the training groups hold no valid row; check the extraction's failures")
        #: every training row fits in the budget: read once, kept for every epoch
        self.kept: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] | None = (
            {} if sum(len(g) for g in groups) * row_bytes <= budget else None
        )

    def _blocks(self) -> list[tuple[int, int, int]]:
        out = []
        for gi, g in enumerate(self.groups):
            out += [(gi, lo, min(lo + self.block_rows, len(g))) for lo in range(0, len(g), self.block_rows)]
        return [out[i] for i in self.rng.permutation(len(out))]

    def _read(self, gi: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        if self.kept is not None and (gi, lo, hi) in self.kept:
            return self.kept[(gi, lo, hi)]
        g = self.groups[gi]
        keep = self.valid[gi][(self.valid[gi] >= lo) & (self.valid[gi] < hi)] - lo
        x = tokens_to_grid([np.asarray(g.kinds[k][lo:hi])[keep] for k in self.kinds], g.geometry.grid)
        out = (x, np.asarray(g.target[lo:hi])[keep].astype(np.int64))
        if self.kept is not None:
            self.kept[(gi, lo, hi)] = out
        return out

    def __call__(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches forever (epoch after epoch), each ``batch_size`` rows (the last of an epoch
        may be short, as a non-dropping loader's)."""
        while True:
            for gi, lo, hi in self._blocks():
                x, y = self._read(gi, lo, hi)
                order = self.rng.permutation(len(x))
                for s in range(0, len(order), batch_size):
                    yield x[order[s : s + batch_size]], y[order[s : s + batch_size]]


class WindowStitcher:
    """DINOv3's ``slide_inference`` over stored windows: each window's logits (at its token
    grid) bilinear to the window (``align_corners=False``, as the head's ``predict`` rescales
    them), summed into its image's resized canvas with a count map; an image whose windows are
    all in is divided by the count and resized bilinear to its original size.

    Every stored window has the window's size (one token grid per group): where a window passes
    a side of the resized image (a side shorter than the window), the extraction padded it, and
    its logits' image part is taken; the reference feeds the model the clipped crop instead."""

    def __init__(self, windows: np.ndarray, crop: tuple[int, int], n_classes: int) -> None:
        self.windows = np.asarray(windows, np.int64)
        self.crop, self.n_classes = crop, n_classes
        self.expected = np.bincount(self.windows[:, 0])
        self.seen: dict[int, int] = {}
        self.canvas: dict[int, tuple[Any, Any]] = {}

    def window_size(self, w: np.ndarray) -> tuple[int, int]:
        """A window's size in the resized image (the crop, clipped to the image's sides)."""
        return min(self.crop[0], int(w[3])), min(self.crop[1], int(w[4]))

    def add(self, row: int, grid_logits: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Add window ``row``'s ``[C, gh, gw]`` logits; ``(image_row, [C, orig_h, orig_w]
        logits)`` when that image is complete, else None."""
        import torch
        import torch.nn.functional as F

        w = self.windows[row]
        img, y0, x0, rh, rw, oh, ow = (int(v) for v in w)
        h, wd = self.window_size(w)
        if img not in self.canvas:
            self.canvas[img] = (torch.zeros(self.n_classes, rh, rw), torch.zeros(1, rh, rw))
        preds, count = self.canvas[img]
        up = F.interpolate(grid_logits[None].float(), size=self.crop, mode="bilinear", align_corners=False)[0]
        preds[:, y0 : y0 + h, x0 : x0 + wd] += up[:, :h, :wd].cpu()  # a padded window: its image part
        count[:, y0 : y0 + h, x0 : x0 + wd] += 1
        self.seen[img] = self.seen.get(img, 0) + 1
        if self.seen[img] < self.expected[img]:
            return None
        del self.canvas[img]
        if (count == 0).any():
            raise DataError(f"the stored windows of image row {img} do not cover its resized image; re-extract it")
        out = F.interpolate((preds / count)[None], size=(oh, ow), mode="bilinear", align_corners=False)[0]
        return img, out


def _blocks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def _grid_logits(head: Any, rows: DenseRows, kinds: tuple[str, ...], lo: int, hi: int, device: str) -> torch.Tensor:
    import torch

    x = tokens_to_grid([np.asarray(rows.kinds[k][lo:hi]) for k in kinds], rows.geometry.grid)
    with torch.no_grad():
        return head.predict(torch.from_numpy(x).to(device))


def _score_windows(
    head: Any, ev: DenseEval, kinds: tuple[str, ...], acc: SegmentationAccumulator, device: str, block: int
) -> None:
    import torch

    win = ev.windows
    assert win is not None
    table = np.asarray(win.tables["window"])
    crop = tuple(int(v) for v in win.geometry.input_size)
    st = WindowStitcher(table, crop, acc.num_classes)  # type: ignore[arg-type]
    full = ev.rows.full["full_mask"]
    valid = np.asarray(ev.rows.valid, bool)
    for lo, hi in _blocks(len(win), block):
        logits = _grid_logits(head, win, kinds, lo, hi, device)
        for j in range(hi - lo):
            done = st.add(lo + j, logits[j])
            if done is None or not valid[done[0]]:
                continue
            img, out = done
            oh, ow = out.shape[1:]
            acc.update(np.asarray(full[img : img + 1])[0, :oh, :ow], torch.argmax(out, 0).numpy())


def _score_resize(
    head: Any, rows: DenseRows, kinds: tuple[str, ...], acc: SegmentationAccumulator, device: str, block: int
) -> None:
    import torch
    import torch.nn.functional as F

    valid = np.asarray(rows.valid, bool)
    for lo, hi in _blocks(len(rows), block):
        logits = _grid_logits(head, rows, kinds, lo, hi, device)
        target = np.asarray(rows.target[lo:hi])
        up = F.interpolate(logits.float(), size=target.shape[1:], mode="bilinear", align_corners=False)
        pred = torch.argmax(up, 1).cpu().numpy()
        for j in np.flatnonzero(valid[lo:hi]):
            acc.update(target[j], pred[j])


def evaluate(
    head: Any, ev: DenseEval, kinds: tuple[str, ...], info: Any, device: str, block: int = 16
) -> tuple[dict[str, float], str]:
    """``(miou, macc, aacc of the split, how)``: stitched windows against the original-size
    masks where the windows are stored (``how="slide"``), else the resize rows against their
    masks (``how="resize"``)."""
    acc = SegmentationAccumulator(
        info.num_classes, ignore_index=IGNORE_INDEX if info.ignore_index is None else info.ignore_index
    )
    head.eval()
    if ev.windows is not None and "full_mask" in ev.rows.full:
        _score_windows(head, ev, kinds, acc, device, block)
        how = "slide"
    else:
        _score_resize(head, ev.rows, kinds, acc, device, block)
        how = "resize"
    return acc.compute(), how


def _loss(logits: torch.Tensor, y: torch.Tensor, ignore: int) -> torch.Tensor:
    """DINOv3's training loss: logits bilinear to the label size, cross-entropy per pixel with
    ``ignore`` contributing 0, averaged over every pixel (``avg_non_ignore=False``)."""
    import torch.nn.functional as F

    if logits.shape[-2:] != y.shape[-2:]:
        logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
    return F.cross_entropy(logits.float(), y, reduction="none", ignore_index=ignore).mean()


def _check_points(iters: int) -> list[int]:
    """The steps after which the selection split is scored (the reference's 8 validations)."""
    return sorted({max(1, round(iters * k / VAL_CHECKS)) for k in range(1, VAL_CHECKS + 1)})


def _labels(y: np.ndarray, n_classes: int, ignore: int) -> np.ndarray:
    y = y.astype(np.int64)
    y[(y < 0) | (y >= n_classes)] = ignore  # ids the dataset does not score count as ignored
    return y


def _train(
    head: Any, task: DenseTask, kinds: tuple[str, ...], grid: Any, cfg: Any, seed: int, device: str, precision: str
) -> dict[str, Any]:
    """Train ``head`` on the task's training groups; score the selection split at the
    :func:`_check_points`; load the best checkpoint. Its record (for the row's hparams)."""
    import torch

    from featcache.core.progress import tqdm

    batches = _Batches(task.train, kinds, cfg.memory // 2, seed)
    iters, warm, bs = schedule_length(grid, batches.n_rows, cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=grid.lr, betas=tuple(grid.betas), weight_decay=grid.weight_decay)
    ignore = IGNORE_INDEX if task.info.ignore_index is None else int(task.info.ignore_index)
    checks, best, history = set(_check_points(iters)), (-math.inf, 0, None), []
    stream = batches(bs)
    for step in tqdm(range(iters), desc="seg-linear", unit="it", disable=not cfg.progress, leave=False):
        head.train()
        x, y = next(stream)
        for g in opt.param_groups:
            g["lr"] = update_lr(step, iters, grid.lr, warm, grid.warmup_ratio)
        xt = torch.from_numpy(x).to(device)
        yt = torch.from_numpy(_labels(y, task.info.num_classes, ignore)).to(device)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = _loss(head(xt), yt, ignore)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step + 1 in checks:
            score, _ = evaluate(head, task.val, kinds, task.info, device)
            history.append(round(score["miou"], 6))
            if score["miou"] > best[0]:
                best = (score["miou"], step + 1, copy.deepcopy(head.state_dict()))
    head.load_state_dict(best[2])
    return {
        "iterations": iters,
        "warmup_iters": warm,
        "batch_size": bs,
        "train_rows": batches.n_rows,
        "block_rows": batches.block_rows,
        "selected_iteration": best[1],
        "val_miou_history": history,
    }


def fit_seg_linear(task: DenseTask, protocol: Any, cfg: Any, seed: int) -> DenseFit:
    """The ``seg-linear`` solver (:data:`~featcache.dense.solvers.DENSE_SOLVERS`): the head of
    ``protocol.grid`` trained on ``task.train``, the checkpoint chosen on ``task.val``, scored
    on ``task.val`` and ``task.test`` (miou, macc, aacc)."""
    import torch

    from featcache.core.devices import resolve_device, resolve_precision

    grid = protocol.grid
    device = resolve_device(cfg.device, cpu_note="no CUDA device; seg-linear trains on CPU", logger=log)
    precision = resolve_precision(cfg.precision, device, logger=log)
    kinds = tuple(task.train[0].kinds)
    channels = sum(int(task.train[0].kinds[k].shape[-1]) for k in kinds)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    head = make_seg_head(channels, task.info.num_classes, grid.dropout).to(device)
    record = _train(head, task, kinds, grid, cfg, seed, device, precision)
    fit_seconds = time.perf_counter() - t0
    val, how_val = evaluate(head, task.val, kinds, task.info, device)
    test, how = evaluate(head, task.test, kinds, task.info, device)
    hparams = {
        "head": grid.head,
        "dropout": grid.dropout,
        "lr": grid.lr,
        "weight_decay": grid.weight_decay,
        "betas": list(grid.betas),
        "schedule": f"WarmupOneCycleLR(warmup_ratio={grid.warmup_ratio}, cos, final_div_factor=inf)",
        "channels": channels,
        "eval": how,
        "val_eval": how_val,
        "ms_tta": "not cached: one scale" if grid.blocks > 1 else False,
        "precision": precision,
        "device": device,
        **record,
    }
    return DenseFit({"val": val, "test": test}, hparams, fit_seconds)
