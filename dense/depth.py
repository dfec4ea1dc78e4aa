"""The dense solver ``depth-linear``: a linear depth head trained on stored token grids and
scored per image with :class:`featcache.core.dense_metrics.DepthAccumulator`.

The recipe is the protocol's :class:`~featcache.core.protocols.dense.DepthLinearGrid` (dinov3's
``dinov3/eval/depth/`` NYU linear head, or DINOv2's ``lin. 1`` / ``lin. 4``):

- training (dinov3 ``train.py:73-122``): each batch's head output (bin depths at the token grid,
  or 4x it) resized bilinearly to the target's size, the loss on the pixels whose target is not
  0 (and valid), AdamW, the gradient norm clipped, :func:`warmup_one_cycle` per step. A cache
  cannot draw the reference's fresh random crop at each iteration: the head trains on the stored
  rows (the augmented views ``train@view{v}`` when stored; ``views`` is recorded). The training
  rows are read in blocks bounded by the config's ``max_memory``, shuffled within a block.
- evaluation (dinov3 ``eval.py:120-186``): the head's depth (on test, with the ``@flip`` rows
  stored, averaged with the flipped-back prediction of the flipped image, as
  ``LeftRightFlipAug.inverse``), resized bilinearly to the ground truth (the original-resolution
  ``full_depth`` where stored, else the row's ``depth``; recorded as ``eval_target``), then the
  range, the Eigen crop and the clamp in the reference's order, per image, averaged over images.
  The reference keeps its last iterate (it validates without selecting); so does featcache, and
  it reports both the val and the test scores of that head.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from featcache.core.dense import DEPTH_KIND, DEPTH_VALID_KIND, FULL_PREFIX, SIZE_FIELDS, SIZE_KIND, DenseRows
from featcache.core.dense_metrics import DepthAccumulator
from featcache.core.memory import parse_memory
from featcache.core.progress import tqdm
from featcache.dense.solvers import DenseEval, DenseFit, DenseTask
from featcache.errors import ConfigError, ProtocolError

__all__ = ["DepthKinds", "depth_kinds", "fit_depth_linear", "predict_depth", "score_depth"]

log = logging.getLogger(__name__)

#: NYUv2's range (config-nyu.yaml ``eval``), used when the dataset declares none
DEFAULT_RANGE = (1e-3, 10.0)
_LAYER = re.compile(r"^layer(\d+)_tokens$")


def _opt(config: Any, name: str, default: Any) -> Any:
    """A config field, or ``default`` where the config has none (or holds None)."""
    v = getattr(config, name, None)
    return default if v is None else v


@dataclass(frozen=True)
class DepthKinds:
    """The stored kinds a head reads: one patch-token kind per block (``[N, gh*gw, D]``) and,
    for DINOv2's heads, the class-token kind of each block (``[N, D]``)."""

    patch: tuple[str, ...]
    cls: tuple[str, ...] = ()


def _even_blocks(layers: list[int]) -> list[int]:
    """DINOv2's four evenly spaced blocks of an ``n``-block model (dinov3 ``encoder.py:45-50``,
    DINOv2 hub ``depthers.py:110-116``: ``[i * (n // 4) - 1]``, ViT-L's ``[4, 11, 17, 23]``)."""
    n = max(layers) + 1
    return [4, 11, 17, 23] if n == 24 else [i * (n // 4) - 1 for i in range(1, 5)]


def _cls_of(kind: str) -> str:
    """The class-token kind stored beside a patch-token kind (``tokens`` -> ``cls``,
    ``layer{i}_tokens`` -> ``layer{i}_cls``)."""
    return "cls" if kind == "tokens" else kind.removesuffix("_tokens") + "_cls"


def depth_kinds(rows: DenseRows, variant: str, blocks: int, kind: str = "tokens") -> DepthKinds:
    """The kinds of ``rows`` a ``variant`` head over ``blocks`` blocks reads: one block is
    ``kind`` (the config's; default ``tokens``); four are the four ``layer{i}_tokens`` kinds
    stored (the stage's runner reads the evenly spaced four), else DINOv2's evenly spaced four
    of the stored blocks. DINOv2's heads add each block's class-token kind."""
    have = set(rows.kinds)
    if blocks == 1:
        patch: tuple[str, ...] = (kind,)
    else:
        stored = sorted(int(m[1]) for k in have if (m := _LAYER.match(k)))
        pick = stored if len(stored) == blocks else _even_blocks(stored) if stored and blocks == 4 else []
        patch = tuple(f"layer{i}_tokens" for i in pick)
    kinds = DepthKinds(patch, tuple(_cls_of(k) for k in patch) if variant == "dinov2" else ())
    missing = [k for k in (*kinds.patch, *kinds.cls) if k not in have] or ([] if patch else ["layer{i}_tokens"])
    if missing:
        raise ProtocolError(
            f"the depth head reads {', '.join(missing)} but split {rows.split!r} holds {sorted(have)}; "
            "extract the blocks it reads (their patch tokens and, for DINOv2's heads, class tokens)"
        )
    return kinds


def _grid_of(rows: DenseRows) -> tuple[int, int]:
    gh, gw = (int(x) for x in rows.geometry.grid)
    return gh, gw


def _inputs(rows: DenseRows, kinds: DepthKinds, sel: Any, device: str) -> tuple[list, list | None]:
    """The blocks' patch grids ``[b, D, gh, gw]`` and class tokens ``[b, D]`` of rows ``sel``
    (a slice, or sorted positions) as float32 tensors on ``device``."""
    import torch

    gh, gw = _grid_of(rows)
    patches = []
    for k in kinds.patch:
        a = np.asarray(rows.kinds[k][sel], dtype=np.float32)
        if a.ndim != 3 or a.shape[1] != gh * gw:
            raise ProtocolError(
                f"kind {k!r} of split {rows.split!r} has shape {a.shape}, not [N, {gh}*{gw}, D] as its geometry "
                "records; re-extract the split"
            )
        t = torch.from_numpy(a).to(device).reshape(a.shape[0], gh, gw, a.shape[2]).permute(0, 3, 1, 2)
        patches.append(t.contiguous())
    cls = [torch.from_numpy(np.asarray(rows.kinds[k][sel], dtype=np.float32)).to(device) for k in kinds.cls]
    return patches, cls or None


def _resize(x: Any, size: tuple[int, int]) -> Any:
    import torch.nn.functional as F

    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=list(size), mode="bilinear", align_corners=False)


def predict_depth(
    head: Any, rows: DenseRows, kinds: DepthKinds, sel: Any, device: str, flip: DenseRows | None = None
) -> Any:
    """The head's ``[b, 1, h, w]`` depth of rows ``sel`` at its output resolution; with ``flip``
    (the same images flipped), the mean with the flipped-back prediction of the flipped rows
    (dinov3 ``transforms.py:153-161``: ``(pred + hflip(pred_flipped)) / 2``, before the resize)."""
    import torch

    with torch.no_grad():
        out = head(*_inputs(rows, kinds, sel, device))
        if flip is not None:
            out = (out + torch.flip(head(*_inputs(flip, kinds, sel, device)), dims=[-1])) / 2
    return out


@dataclass(frozen=True)
class _Plan:
    """How a fit runs: its step count, warm-up, batch, rows read per block, device."""

    iterations: int
    warmup: int
    batch_size: int
    block_rows: int
    device: str
    progress: bool
    precision: str = "fp32"


def _row_bytes(rows: DenseRows, kinds: DepthKinds) -> int:
    """float32 bytes one training row takes in memory (its kinds and its target + mask)."""
    n = sum(int(np.prod(rows.kinds[k].shape[1:])) * 4 for k in (*kinds.patch, *kinds.cls))
    return n + int(np.prod(np.asarray(rows.target.shape[1:]))) * 5


def _plan(grid: Any, config: Any, train: list[DenseRows], kinds: DepthKinds) -> _Plan:
    """The schedule: the config's ``iterations``, else ``epochs`` passes over the training rows,
    else the grid's; the warm-up keeps the grid's fraction of it (config-nyu: 12800 / 38400)."""
    from featcache.core.devices import resolve_device, resolve_precision

    bs = int(_opt(config, "batch_size", grid.batch_size))
    n_rows = sum(len(r) for r in train)
    iters = _opt(config, "iterations", None)
    epochs = _opt(config, "epochs", None)
    if iters is None and epochs is not None:
        iters = math.ceil(float(epochs) * math.ceil(n_rows / bs))
    iters = int(iters or grid.iterations)
    if iters < 1 or bs < 1:
        raise ConfigError(f"depth-linear needs iterations >= 1 and batch_size >= 1, got {iters} and {bs}")
    budget = parse_memory(_opt(config, "max_memory", None), default=2 << 30)
    block = max(bs, budget // max(1, max(_row_bytes(r, kinds) for r in train)))
    device = resolve_device(str(_opt(config, "device", "auto")), logger=log)
    precision = resolve_precision(str(_opt(config, "precision", "fp32")), device, logger=log)
    warm = round(iters * grid.warmup_iters / grid.iterations)
    return _Plan(iters, warm, bs, int(block), device, bool(_opt(config, "progress", False)), precision)


def _load_block(rows: DenseRows, kinds: DepthKinds, sel: slice, device: str) -> tuple:
    """One block of training rows in memory: (patch grids, class tokens, target, loss mask),
    the rows marked invalid or without a valid pixel dropped (they add nothing to a batch's
    loss); the mask is the reference's ``gt != 0`` and the stored validity."""
    import torch

    target = np.asarray(rows.target[sel], dtype=np.float32)
    ok_np = target != 0
    if rows.target_valid is not None:
        ok_np &= np.asarray(rows.target_valid[sel]).astype(bool)
    keep = np.flatnonzero(np.asarray(rows.valid[sel], dtype=bool) & ok_np.reshape(len(ok_np), -1).any(1))
    patches, cls = _inputs(rows, kinds, sel, device)
    tgt = torch.from_numpy(target).to(device)[:, None]
    ok = torch.from_numpy(ok_np).to(device)[:, None]
    idx = torch.from_numpy(keep).to(device)
    pick = [p[idx] for p in patches]
    return pick, None if cls is None else [c[idx] for c in cls], tgt[idx], ok[idx]


def _batches(train: list[DenseRows], kinds: DepthKinds, plan: _Plan, gen: np.random.Generator):
    """Batches without end: per pass the row blocks of every training group in a seeded order,
    each block's rows shuffled. Where every row fits the memory bound the blocks are read once
    and held (one block holding every row: a plain shuffle); else each pass reads them again."""
    import torch

    blocks = [
        (g, s, min(s + plan.block_rows, len(r))) for g, r in enumerate(train) for s in range(0, len(r), plan.block_rows)
    ]
    hold = sum(e - s for _, s, e in blocks) <= plan.block_rows  # every row fits the bound
    held: dict[int, tuple] = {}
    while True:
        rows_seen = 0
        for b in gen.permutation(len(blocks)):
            g, s, e = blocks[b]
            block = held.get(b) or _load_block(train[g], kinds, slice(s, e), plan.device)
            if hold:
                held[b] = block
            patches, cls, tgt, ok = block
            rows_seen += len(tgt)
            order = torch.from_numpy(gen.permutation(len(tgt))).to(plan.device)
            for i in range(0, len(order), plan.batch_size):
                j = order[i : i + plan.batch_size]
                yield [p[j] for p in patches], None if cls is None else [c[j] for c in cls], tgt[j], ok[j]
        if not rows_seen:
            raise ProtocolError("no training row has a valid depth pixel; check the stored depth targets")


def _train(head: Any, train: list[DenseRows], kinds: DepthKinds, grid: Any, plan: _Plan, seed: int) -> float:
    """Fit ``head`` for ``plan.iterations`` steps (dinov3 ``train.py:73-122``); the last loss
    (read once at the end: no device synchronisation per step beyond the reference's own)."""
    import torch

    from featcache.dense.depth_losses import SigLoss, gradient_log_loss, warmup_one_cycle

    opt = torch.optim.AdamW(head.parameters(), lr=grid.lr, betas=tuple(grid.betas), weight_decay=grid.weight_decay)
    sig = SigLoss(warm_up=grid.sigloss_warmup > 0, warm_iter=grid.sigloss_warmup)
    head.train()
    batches = _batches(train, kinds, plan, np.random.default_rng(seed))
    last = None
    with tqdm(total=plan.iterations, desc="depth-linear", unit="step", disable=not plan.progress) as bar:
        for step in range(plan.iterations):
            patches, cls, tgt, ok = next(batches)  # every batch has a valid pixel (_load_block)
            lr, beta1 = warmup_one_cycle(
                step, plan.iterations, plan.warmup, grid.lr, final_div_factor=grid.final_div_factor
            )
            for g in opt.param_groups:
                g["lr"], g["betas"] = lr, (beta1, g["betas"][1])
            opt.zero_grad(set_to_none=True)
            with torch.autocast(plan.device.split(":")[0], dtype=torch.bfloat16, enabled=plan.precision == "bf16"):
                out = head(patches, cls)
            pred = _resize(out.float(), tuple(tgt.shape[-2:]))  # the loss in float32
            loss = sig(pred, tgt, ok)
            if grid.grad_weight:
                loss = loss + grid.grad_weight * gradient_log_loss(pred, tgt, ok)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], grid.clip)
            opt.step()
            last = loss.detach()
            bar.update(1)
    head.eval()
    return float(last) if last is not None else float("nan")


def _ground_truth(rows: DenseRows, sel: slice, full: bool) -> list[np.ndarray]:
    """Each image's ground truth (0 where invalid): the original-resolution ``full_depth``
    cropped to the image's own size when stored, else the row's ``depth``."""
    if full:
        sizes = np.asarray(rows.tables[SIZE_KIND][sel])
        h, w = SIZE_FIELDS.index("orig_h"), SIZE_FIELDS.index("orig_w")
        depth = np.asarray(rows.full[FULL_PREFIX + DEPTH_KIND][sel], dtype=np.float32)
        vk = FULL_PREFIX + DEPTH_VALID_KIND
        valid = np.asarray(rows.full[vk][sel]).astype(bool) if vk in rows.full else np.ones(depth.shape, bool)
        return [np.where(v, d, 0)[: s[h], : s[w]] for d, v, s in zip(depth, valid, sizes)]
    depth = np.asarray(rows.target[sel], dtype=np.float32)
    valid = np.ones(depth.shape, bool) if rows.target_valid is None else np.asarray(rows.target_valid[sel]).astype(bool)
    return list(np.where(valid, depth, 0))


def score_depth(
    head: Any,
    ev: DenseEval,
    kinds: DepthKinds,
    *,
    tta: bool,
    depth_range: tuple[float, float],
    eigen: bool,
    device: str,
    batch_size: int = 16,
) -> tuple[dict[str, float], dict[str, Any]]:
    """The depth metrics of ``ev`` (per image, averaged over images) and how they were taken
    (``eval_target``, ``tta``, ``images``)."""
    import torch

    rows = ev.rows
    full = FULL_PREFIX + DEPTH_KIND in rows.full and SIZE_KIND in rows.tables
    flip = ev.flip if tta else None
    if flip is not None and list(np.asarray(flip.ids)) != list(np.asarray(rows.ids)):
        raise ProtocolError(f"the @flip rows of split {rows.split!r} are not its rows in order; re-extract the split")
    acc = DepthAccumulator(min_depth=depth_range[0], max_depth=depth_range[1], eigen_crop=eigen)
    valid = np.asarray(rows.valid, dtype=bool)
    per_image = np.full(len(rows), np.nan)
    for s in range(0, len(rows), batch_size):
        sel = slice(s, min(s + batch_size, len(rows)))
        pred = predict_depth(head, rows, kinds, sel, device, flip)
        for j, gt in enumerate(_ground_truth(rows, sel, full)):
            if valid[s + j]:
                p = _resize(pred[j : j + 1], gt.shape)[0, 0]
                acc.update(gt, p.to(torch.float64).cpu().numpy())
                per_image[s + j] = acc.values["rmse"][-1]
    info = {
        "eval_target": FULL_PREFIX + DEPTH_KIND if full else DEPTH_KIND,
        "tta": flip is not None,
        "images": acc.n_images,
        "per_image_rmse": per_image,
    }
    return acc.compute(), info


def _build_head(grid: Any, dim: int, n_blocks: int, max_depth: float, seed: int, device: str) -> Any:
    """The grid's head, its initialisation drawn from ``seed`` (the process's RNG untouched)."""
    import torch

    from featcache.dense.depth_heads import DepthLinearHead

    if grid.variant not in ("dinov3", "dinov2"):
        raise ProtocolError(f"depth-linear variant must be 'dinov3' or 'dinov2', got {grid.variant!r}")
    v3 = grid.variant == "dinov3"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = DepthLinearHead(
            dim,
            n_blocks,
            use_cls=not v3,
            batchnorm=v3,
            upsample=1 if v3 else 4,
            n_bins=grid.n_bins,
            min_depth=grid.min_depth,
            max_depth=max_depth,
            init_std=0.01 if v3 else None,
        )
    return head.to(device)


def fit_depth_linear(task: DenseTask, protocol: Any, config: Any, seed: int) -> DenseFit:
    """Train ``protocol``'s linear depth head on ``task.train`` and score its last iterate on
    ``task.val`` and ``task.test`` (flip-averaged on test where the grid asks and ``@flip`` rows
    are stored). ``config``: ``batch_size``, ``iterations`` / ``epochs``, ``device``,
    ``max_memory``, ``kind``, ``progress`` are read where present. ``per_image[role]``: each
    image's RMSE (the headline metric), NaN where an image has no valid pixel."""
    grid = protocol.grid
    if task.info.task != "depth":
        raise ProtocolError(f"{protocol.spec} scores depth, but the dataset is a {task.info.task!r} dataset")
    if grid.eval_crop not in ("eigen", "full"):
        raise ProtocolError(f"eval_crop must be 'eigen' or 'full', got {grid.eval_crop!r}")
    if not task.train:
        raise ProtocolError(f"{protocol.spec} has no training rows; extract the train split")
    t0 = time.perf_counter()
    kinds = depth_kinds(task.train[0], grid.variant, grid.blocks, str(_opt(config, "kind", "tokens")))
    lo, hi = task.info.depth_range or DEFAULT_RANGE
    rng = (float(lo), float(hi))
    max_depth = float(grid.max_depth or rng[1])
    plan = _plan(grid, config, task.train, kinds)
    dim = int(task.train[0].kinds[kinds.patch[0]].shape[-1])
    head = _build_head(grid, dim, len(kinds.patch), max_depth, seed, plan.device)
    final_loss = _train(head, task.train, kinds, grid, plan, seed)
    fit_s = time.perf_counter() - t0
    scores, how = {}, {}
    for role, ev in (("val", task.val), ("test", task.test)):
        tta = grid.tta and role == "test"
        scores[role], how[role] = score_depth(
            head,
            ev,
            kinds,
            tta=tta,
            depth_range=rng,
            eigen=grid.eval_crop == "eigen",
            device=plan.device,
            batch_size=plan.batch_size,
        )
    views = sum(r.geometry.name.startswith("view") for r in task.train)
    hparams = {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()},
        "iterations": plan.iterations,
        "warmup_iters": plan.warmup,
        "batch_size": plan.batch_size,
        "precision": plan.precision,  # of the training steps; evaluation computes in float32
        "bins_max_depth": max_depth,
        "eval_range": list(rng),
        "kinds": [*kinds.patch, *kinds.cls],
        "views": views,
        "train_rows": sum(len(r) for r in task.train),
        "final_loss": final_loss,
        "eval_target": how["test"]["eval_target"],
        "tta_test": how["test"]["tta"],
    }
    log.info(
        "%s: test rmse %.4f after %d steps (%.1f s)", protocol.spec, scores["test"]["rmse"], plan.iterations, fit_s
    )
    fit = DenseFit(scores, hparams, fit_s)
    # the headline metric's per-image values in the eval split's row order (NaN: a row without a
    # valid pixel or marked invalid), for intervals over images (DenseFit.per_image)
    fit.per_image = {role: how[role]["per_image_rmse"] for role in how}  # pyright: ignore[reportAttributeAccessIssue]
    return fit
