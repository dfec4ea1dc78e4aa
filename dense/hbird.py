"""Hummingbird dense nearest-neighbour evaluation from stored patch-token grids (issue 57), as
vpariza/open-hummingbird-eval ``hbird/hbird_eval.py`` computes it (commit 5e79da29; the port in
tests/dense/test_hbird_port.py holds the two equal on the same tokens and masks):

- **memory**: every patch of every stored training view (``task.train``: the ``train@view{v}``
  groups are its augmentation epochs, in order), each feature L2-normalised without an epsilon
  (``features / torch.norm``), its label the patch's per-class pixel fractions of the mask at
  the input size (``_patchify_gt`` + ``one_hot(...).mean``), after the reference's relabelling
  of the ignore index to class 0 *in the memory only* (``y[y == 255] = 0``; featcache maps any
  id outside ``[0, num_classes)`` the same way, where the reference would fail);
- **bounded memory** (``memory_size``): the reference's class-balanced sampling, ``memory_size
  // (images x epochs)`` patches per image, each patch scored by the image-level frequency of
  its classes times a uniform draw (torch's CPU stream, batch by batch of ``batch_size`` images,
  as ``_sample_features`` draws it), the smallest scores kept;
- **search**: FAISS exact inner product of the raw query tokens against the normalised memory
  (the reference's ``GpuIndexFlatIP``, on the CPU here; its default ScaNN is approximate), k = 30;
  or ``index`` = a ``faiss.index_factory`` string (``IVF1024,Flat``, ``HNSW32``, ``IVF256,PQ16``)
  for banks that outgrow memory, spelled as ``featcache retrieve --index`` spells it;
- **label transfer**: softmax over the k neighbours of cosine / 0.02, the neighbours' soft
  labels summed with those weights, reshaped to the token grid, bilinearly upsampled to the
  target size (``align_corners=False``) and argmaxed;
- **score**: :class:`featcache.core.dense_metrics.HummingbirdAccumulator` (``hbird_miou``: the
  Hungarian-matched mIoU over all classes; never seg-linear's ``miou``), the ignore index left
  out of the evaluation targets (never relabelled there, as in the reference).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.core.dense import DenseRows
from featcache.core.dense_metrics import IGNORE_INDEX, HummingbirdAccumulator
from featcache.dense.solvers import DenseEval, DenseFit, DenseTask
from featcache.errors import ConfigError, DataError

__all__ = [
    "EXACT",
    "HbirdMemory",
    "HbirdSettings",
    "build_index",
    "build_memory",
    "build_streamed_index",
    "check_index",
    "hummingbird",
    "label_transfer",
    "memory_blocks",
    "patch_labels",
    "patchify",
    "predict_maps",
    "sample_patches",
    "score_split",
    "settings_from",
]

log = logging.getLogger(__name__)

#: the default search: FAISS exact inner product (``IndexFlatIP``)
EXACT = "exact"
#: the memory's relabelling of the ignore index (the reference's ``y[y == 255] = 0``)
MEMORY_IGNORE_AS = 0
#: rows an approximate index is trained on at most (a seeded sample of the memory)
INDEX_TRAIN_ROWS = 200_000


@dataclass(frozen=True)
class HbirdSettings:
    """What one Hummingbird run uses: the grid's ``k``, ``temperature``, ``memory_size`` (None:
    every training patch) and ``batch_size`` (images per sampling draw and per query block), the
    config's ``kind``, ``index`` and its ``nprobe``/``ef_search``."""

    k: int = 30
    temperature: float = 0.02
    memory_size: int | None = None
    batch_size: int = 64
    kind: str = "tokens"
    index: str = EXACT
    nprobe: int | None = None
    ef_search: int | None = None
    progress: bool = True  # a progress bar of the memory's blocks (not recorded)

    def __post_init__(self) -> None:
        if self.k < 1 or self.batch_size < 1:
            raise ConfigError(f"hummingbird needs k >= 1 and batch_size >= 1, got k={self.k}, batch={self.batch_size}")
        if not self.temperature > 0:
            raise ConfigError(f"hummingbird temperature must be > 0, got {self.temperature}")
        if self.memory_size is not None and self.memory_size < 1:
            raise ConfigError(f"memory_size must be >= 1 (or None: every patch), got {self.memory_size}")
        if self.index == EXACT and (self.nprobe is not None or self.ef_search is not None):
            raise ConfigError("nprobe / ef_search need index=FACTORY (an IVF or HNSW index), not exact search")

    def record(self) -> dict[str, Any]:
        """The hparams a result row records."""
        return {
            "k": self.k,
            "temperature": self.temperature,
            "memory_size": self.memory_size,
            "batch_size": self.batch_size,
            "kind": self.kind,
            "index": self.index,
            "nprobe": self.nprobe,
            "ef_search": self.ef_search,
            "memory_ignore_as": MEMORY_IGNORE_AS,
        }


def settings_from(protocol: Any, config: Any) -> HbirdSettings:
    """The run's settings: the protocol grid's ``k``/``temperature``/``memory_size``/
    ``batch_size``, overridden by a config field of the same name that is not None, and the
    config's ``kind`` (``pooled``/None: ``tokens``), ``index``, ``nprobe``, ``ef_search``."""
    grid = getattr(protocol, "grid", None)
    vals: dict[str, Any] = {}
    for name in ("k", "temperature", "memory_size", "batch_size"):
        v = getattr(config, name, None)
        vals[name] = v if v is not None else getattr(grid, name, getattr(HbirdSettings, name))
    kind = getattr(config, "kind", None)
    vals["kind"] = "tokens" if kind in (None, "", "pooled") else str(kind)
    vals["index"] = str(getattr(config, "index", None) or EXACT).strip() or EXACT
    vals["nprobe"] = getattr(config, "nprobe", None)
    vals["ef_search"] = getattr(config, "ef_search", None)
    vals["progress"] = bool(getattr(config, "progress", True))
    return HbirdSettings(**vals)


def _grid_of(rows: DenseRows, kind: str, n_tokens: int) -> tuple[int, int]:
    gh, gw = (int(x) for x in rows.geometry.grid)
    if gh * gw != n_tokens:
        raise DataError(
            f"{rows.split}: kind {kind!r} holds {n_tokens} tokens per row but its geometry records a "
            f"{gh}x{gw} grid; re-extract the split (the tokens and the recorded geometry disagree)"
        )
    return gh, gw


def patchify(mask: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """``[B, H, W]`` ids -> ``[B, gh*gw, ph*pw]`` int64, each token's pixels (the reference's
    ``_patchify_gt``, row-major over the grid); ``H``/``W`` must be multiples of ``gh``/``gw``."""
    m = np.asarray(mask)
    b, h, w = m.shape
    gh, gw = grid
    if h % gh or w % gw:
        raise DataError(
            f"target {h}x{w} is not a whole number of {gh}x{gw} token patches; extract at an input size "
            "that is a multiple of the backbone's stride (hummingbird labels each patch by its pixels)"
        )
    ph, pw = h // gh, w // gw
    p = m.reshape(b, gh, ph, gw, pw).transpose(0, 1, 3, 2, 4)
    return p.reshape(b, gh * gw, ph * pw).astype(np.int64)


def _memory_ids(ids: np.ndarray, num_classes: int) -> np.ndarray:
    """The memory's relabelling: the ignore index (any id outside the classes) -> class 0."""
    out = ids.copy()
    out[(out < 0) | (out >= num_classes)] = MEMORY_IGNORE_AS
    return out


def patch_labels(patch_ids: np.ndarray, num_classes: int) -> np.ndarray:
    """``[B, T, P]`` ids in ``[0, C)`` -> ``[B, T, C]`` float32 per-class pixel fractions
    (``F.one_hot(...).float().mean(dim=3)``: counts / P, each exact in float32)."""
    b, t, p = patch_ids.shape
    flat = (patch_ids + np.arange(b * t, dtype=np.int64).reshape(b, t, 1) * num_classes).ravel()
    counts = np.bincount(flat, minlength=b * t * num_classes).reshape(b, t, num_classes)
    return counts.astype(np.float32) / np.float32(p)


def sample_patches(patch_ids: np.ndarray, num_classes: int, per_image: int, generator: Any) -> np.ndarray:
    """The reference's bounded-memory choice (``HbirdEvaluation._sample_features``): ``[B, K]``
    token indices per image, least-frequent classes first, ties broken by ``torch.rand`` drawn
    once per batch from ``generator`` over the non-empty patches in order."""
    import torch

    b, t, _ = patch_ids.shape
    if per_image > t:
        raise ConfigError(
            f"memory_size asks {per_image} patches per image but a row holds {t}; lower memory_size "
            "or leave it unset (every training patch)"
        )
    flat = torch.as_tensor(patch_ids.reshape(b * t, -1))
    offsets = torch.arange(b * t, dtype=torch.long).unsqueeze(1) * num_classes
    counts = torch.bincount((flat + offsets).reshape(-1), minlength=b * t * num_classes).reshape(b, t, num_classes)
    presence = counts > 0
    class_freq = presence.sum(dim=1).to(torch.float32)
    scores = torch.einsum("bpc,bc->bp", presence.to(torch.float32), class_freq)
    nonzero = presence.any(dim=2)
    scores.masked_fill_(~nonzero, 1e6)
    nz = nonzero.sum(dim=1).tolist()
    if sum(nz) > 0:
        r = torch.rand(sum(nz), generator=generator)
        rand_map = torch.ones_like(scores)
        start = 0
        for i, cnt in enumerate(nz):
            if cnt:
                rand_map[i, nonzero[i]] = r[start : start + cnt]
                start += cnt
        scores.mul_(rand_map)
    return torch.topk(scores, per_image, largest=False).indices.numpy()


@dataclass
class HbirdMemory:
    """The memory bank: ``features`` ``[M, D]`` float32 L2-normalised, ``labels`` ``[M, C]``
    float32 soft labels (torch tensors), and how many images and epochs filled it."""

    features: Any
    labels: Any
    images: int
    epochs: int


def _blocks(rows: DenseRows, kind: str, batch: int):
    """``(tokens float32 [b, T, D], target [b, H, W], keep)`` row blocks of ``rows``."""
    valid = np.asarray(rows.valid, bool) if rows.valid is not None else np.ones(len(rows), bool)
    for i in range(0, len(rows), batch):
        j = min(i + batch, len(rows))
        keep = valid[i:j]
        tok = np.asarray(rows.kinds[kind][i:j], dtype=np.float32)[keep]
        yield tok, np.asarray(rows.target[i:j])[keep], keep


def _kind_of(rows: DenseRows, kind: str) -> Any:
    if kind not in rows.kinds:
        raise DataError(
            f"{rows.split}: no {kind!r} tokens stored (it holds {sorted(rows.kinds)}); extract --features "
            f"{kind} or choose a stored token kind"
        )
    return rows.kinds[kind]


def _per_image(groups: list[DenseRows], s: HbirdSettings) -> int | None:
    """The bounded memory's patches per image (``memory_size // (images x epochs)``), None unbounded."""
    if not groups:
        raise DataError("hummingbird needs training rows (train@view{v} groups or the train split); none stored")
    images = len(groups[0])
    per = None if s.memory_size is None else s.memory_size // max(1, images * len(groups))
    if per == 0:
        raise ConfigError(
            f"memory_size {s.memory_size} is less than one patch per image ({images} images x {len(groups)} "
            "epochs); raise memory_size or leave it unset (every training patch)"
        )
    return per


def memory_blocks(groups: list[DenseRows], s: HbirdSettings, num_classes: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """The memory block by block, in order: ``(features [n, D], labels [n, C])`` float32 torch
    tensors, the features L2-normalised; the bounded sampling's generator is seeded anew each
    call, so every pass yields the same blocks."""
    import torch

    from featcache.core.progress import tqdm

    per = _per_image(groups, s)
    gen = torch.Generator().manual_seed(int(seed))
    total = sum((len(g) + s.batch_size - 1) // s.batch_size for g in groups)
    with tqdm(total=total, desc="hummingbird memory", unit="block", leave=False, disable=not s.progress) as bar:
        for g in groups:
            _kind_of(g, s.kind)
            for tok, tgt, _ in _blocks(g, s.kind, s.batch_size):
                grid = _grid_of(g, s.kind, tok.shape[1])
                ids = _memory_ids(patchify(tgt, grid), num_classes)
                f, lab = torch.from_numpy(tok), torch.from_numpy(patch_labels(ids, num_classes))
                if per is not None:
                    idx = torch.from_numpy(sample_patches(ids, num_classes, per, gen))
                    f = f.gather(1, idx.unsqueeze(-1).expand(-1, -1, f.shape[2]))
                    lab = lab.gather(1, idx.unsqueeze(-1).expand(-1, -1, lab.shape[2]))
                bar.update(1)
                yield (f / torch.norm(f, dim=2, keepdim=True)).flatten(0, 1), lab.flatten(0, 1)


def build_memory(groups: list[DenseRows], s: HbirdSettings, num_classes: int, seed: int) -> HbirdMemory:
    """The memory of every training patch of ``groups`` (one group per augmentation epoch), or
    the reference's bounded class-balanced sample of ``s.memory_size`` of them, in memory."""
    import torch

    feats, labs = zip(*memory_blocks(groups, s, num_classes, seed), strict=True)
    return HbirdMemory(torch.cat(feats), torch.cat(labs), len(groups[0]), len(groups))


#: dimensions a factory string is tried with before any memory exists (config time), as
#: retrieval's check does: 1536 divides by every usual PQ size, 720 and 1000 catch the rest
_PROBE_DIMS = (1536, 720, 1000)


def _faiss_line(exc: Exception | None) -> str:
    text = " ".join(str(exc).split())
    return text.rsplit("Error: ", 1)[-1][-200:]


def check_index(spec: str) -> None:
    """Refuse, in one line, a ``faiss.index_factory`` string FAISS cannot build."""
    from featcache.core.optional import import_faiss

    faiss = import_faiss()
    last: Exception | None = None
    for d in _PROBE_DIMS:
        try:
            faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
            return
        except RuntimeError as exc:
            last = exc
    raise ConfigError(
        f"index {spec!r}: FAISS cannot build it ({_faiss_line(last)}); write exact or a factory string "
        "such as IVF1024,Flat or HNSW32"
    )


def build_index(memory: HbirdMemory, s: HbirdSettings, seed: int) -> Any:
    """The FAISS inner-product index over the normalised memory: ``IndexFlatIP`` (exact) or
    ``faiss.index_factory(D, s.index, METRIC_INNER_PRODUCT)`` trained on a seeded sample."""
    from featcache.core.optional import import_faiss

    faiss = import_faiss()
    x = np.ascontiguousarray(memory.features.numpy(), dtype=np.float32)
    if s.index == EXACT:
        index = faiss.IndexFlatIP(x.shape[1])
    else:
        index = _factory_index(x.shape[1], s)
        if not index.is_trained:
            rows = np.random.default_rng(seed).permutation(len(x))[:INDEX_TRAIN_ROWS]
            index.train(x[np.sort(rows)])
    index.add(x)
    return index


def _memory_rows(groups: list[DenseRows], s: HbirdSettings) -> int:
    """How many rows the memory of ``groups`` holds (read from the shapes, before any block)."""
    per = _per_image(groups, s)
    n = 0
    for g in groups:
        valid = int(np.sum(np.asarray(g.valid, bool))) if g.valid is not None else len(g)
        n += valid * (per if per is not None else int(_kind_of(g, s.kind).shape[1]))
    return n


def _factory_index(d: int, s: HbirdSettings) -> Any:
    from featcache.core.optional import import_faiss

    faiss = import_faiss()
    try:
        index = faiss.index_factory(d, s.index, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ConfigError(f"index {s.index!r}: FAISS cannot build it ({_faiss_line(exc)})") from exc
    params = faiss.ParameterSpace()
    for name, v in (("nprobe", s.nprobe), ("efSearch", s.ef_search)):
        if v is not None:
            params.set_index_parameter(index, name, int(v))
    return index


def build_streamed_index(
    groups: list[DenseRows], s: HbirdSettings, num_classes: int, seed: int
) -> tuple[Any, HbirdMemory]:
    """``s.index`` (a factory string) built without holding the float32 memory: one pass picks
    the seeded training sample (the rows :func:`build_index` would train on), a second adds
    block by block; the memory returned keeps the labels only (``features`` None)."""
    import torch

    d = int(_kind_of(groups[0], s.kind).shape[2])
    index = _factory_index(d, s)
    if not index.is_trained:
        pick = np.sort(np.random.default_rng(seed).permutation(_memory_rows(groups, s))[:INDEX_TRAIN_ROWS])
        sample, at = [], 0
        for f, _ in memory_blocks(groups, s, num_classes, seed):
            j = pick[(pick >= at) & (pick < at + len(f))] - at
            sample.append(f.numpy()[j])
            at += len(f)
        index.train(np.ascontiguousarray(np.concatenate(sample), dtype=np.float32))
    labs = []
    for f, lab in memory_blocks(groups, s, num_classes, seed):
        index.add(np.ascontiguousarray(f.numpy(), dtype=np.float32))
        labs.append(lab)
    return index, HbirdMemory(None, torch.cat(labs), len(groups[0]), len(groups))


def label_transfer(q: Any, keys: Any, values: Any, temperature: float) -> Any:
    """The reference's ``_cross_attention``: ``q`` ``[B, N, D]``, ``keys`` ``[B, N, k, D]``,
    ``values`` ``[B, N, k, C]`` -> ``[B, N, C]`` = softmax(cos(q, keys) / temperature) @ values."""
    import torch
    import torch.nn.functional as F

    q, keys = F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
    b, n, d = q.shape
    k = keys.size(2)
    attn = torch.bmm(q.reshape(b * n, 1, d), keys.reshape(b * n, k, d).transpose(1, 2)).squeeze(1) / temperature
    attn = F.softmax(attn, dim=-1)
    return torch.bmm(attn.unsqueeze(1), values.reshape(b * n, k, -1)).squeeze(1).view(b, n, -1)


def _transfer_scores(scores: np.ndarray, q: Any, values: Any, temperature: float) -> Any:
    """Label transfer from an index's inner products (approximate indexes: the memory's features
    are not kept beside them): cos = score / |q|."""
    import torch
    import torch.nn.functional as F

    b, n, _ = q.shape
    qn = torch.norm(q.reshape(b * n, -1), dim=1, keepdim=True).clamp_min(1e-12)
    attn = F.softmax(torch.from_numpy(scores) / qn / temperature, dim=-1)
    return torch.bmm(attn.unsqueeze(1), values.reshape(b * n, attn.shape[1], -1)).squeeze(1).view(b, n, -1)


def predict_maps(
    tok: np.ndarray, grid: tuple[int, int], size: tuple[int, int], memory: HbirdMemory, index: Any, s: HbirdSettings
) -> np.ndarray:
    """Predicted id maps ``[B, H, W]`` int64 of a block of query tokens ``[B, T, D]``: search,
    label transfer, the grid's soft labels upsampled bilinearly to ``size`` and argmaxed."""
    import torch
    import torch.nn.functional as F

    q = torch.from_numpy(np.ascontiguousarray(tok, dtype=np.float32))
    b, n, d = q.shape
    scores, idx = index.search(q.reshape(b * n, d).numpy(), s.k)
    if (idx < 0).any():
        raise DataError(f"the memory holds fewer than k={s.k} reachable patches; lower k or grow the memory")
    flat = torch.as_tensor(idx, dtype=torch.long).flatten()
    values = memory.labels.index_select(0, flat).view(b, n, s.k, -1)
    if s.index == EXACT:
        keys = memory.features.index_select(0, flat).view(b, n, s.k, -1)
        soft = label_transfer(q, keys, values, s.temperature)
    else:
        soft = _transfer_scores(scores, q, values, s.temperature)
    soft = soft.reshape(b, grid[0], grid[1], -1).permute(0, 3, 1, 2)
    up = F.interpolate(soft.float(), size=size, mode="bilinear")
    return up.argmax(dim=1).numpy()


def score_split(
    ev: DenseEval, memory: HbirdMemory, index: Any, s: HbirdSettings, num_classes: int, ignore_index: int | None
) -> float:
    """``hbird_miou`` of an evaluation split's ``resize`` rows (their targets at the input size,
    as the reference scores them), streamed in blocks of ``s.batch_size`` images."""
    rows = ev.rows
    _kind_of(rows, s.kind)
    acc = HummingbirdAccumulator(num_classes, ignore_index=ignore_index)
    for tok, tgt, _ in _blocks(rows, s.kind, s.batch_size):
        if len(tok) == 0:
            continue
        grid = _grid_of(rows, s.kind, tok.shape[1])
        acc.update(tgt, predict_maps(tok, grid, tuple(tgt.shape[1:]), memory, index, s))
    return acc.compute()


def hummingbird(task: DenseTask, protocol: Any, config: Any, seed: int) -> DenseFit:
    """The Hummingbird solver: memory from ``task.train``, ``hbird_miou`` of ``val`` and
    ``test`` (nothing is fitted or selected: the grid is one point)."""
    s = settings_from(protocol, config)
    info = task.info
    if info.task != "seg":
        raise ConfigError(f"hummingbird evaluates segmentation datasets; {info.task!r} is not one")
    ignore = IGNORE_INDEX if info.ignore_index is None else int(info.ignore_index)
    t0 = time.perf_counter()
    if s.index == EXACT:
        memory = build_memory(task.train, s, info.num_classes, seed)
        index = build_index(memory, s, seed)
    else:  # the index holds what search needs; the float32 memory is never held whole
        index, memory = build_streamed_index(task.train, s, info.num_classes, seed)
    fit_s = time.perf_counter() - t0
    log.info("hummingbird memory: %d patches (%d epochs), %s search", len(memory.labels), memory.epochs, s.index)
    scores = {
        role: {"hbird_miou": score_split(ev, memory, index, s, info.num_classes, ignore)}
        for role, ev in (("val", task.val), ("test", task.test))
    }
    hp = {**s.record(), "memory_rows": len(memory.labels), "memory_epochs": memory.epochs}
    return DenseFit(scores, hparams=hp, fit_seconds=fit_s)
