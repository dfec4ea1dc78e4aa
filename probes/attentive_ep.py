"""The efficient probe ``attentive:ep`` (arXiv 2506.10178) on cached tokens.

The head is ``ep`` of :mod:`featcache.probes.attentive_modules` (billpsomas/efficient-probing at
b8f4fb8 ``poolings/ep.py`` + ``probe_heads.py``: learned queries without q/k projections, one
value projection sliced per query, a non-affine BatchNorm and the linear classifier). The
recipe is the reference's ``main_linprobe.py`` / ``engine_finetune.py:22-103``: the head alone
trained with LARS (``util/lars.py``: momentum 0.9, trust 0.001, weight decay 0), lr = blr 0.1 x
batch / 256 (1.6 at its batch 4096), set before every iteration by ``util/lr_sched.py`` (10
warm-up epochs then a half-cycle cosine to 0 at 90 epochs), cross-entropy, last partial batch
dropped (``drop_last=True``); after each epoch the val top-1, and the best epoch's head kept
(``main_linprobe.py:655-659``: the first epoch with the highest val top-1).

Input (``ep_all``, ``models_vit.py:313-315`` / ``models_more.py:31-34``): the class token
followed by the patch tokens, ``[n, 1 + T, D]``, where the store holds ``cls`` beside ``tokens``;
patch tokens alone (the reference's ``ep``) where the backbone has no class token. featcache's
``cls`` and ``tokens`` are a ViT's outputs through its final norm (timm ``forward_features``;
the reference's DINOv2 loader, ``get_intermediate_layers(norm=True)``, feeds the same, its
``models_vit.py`` ViTs feed blocks' outputs before the final norm), a CNN's final map.

What cannot be followed from stored features, recorded in every row's ``hparams.deviation``:
the reference draws a fresh random-resized crop of every image each epoch; featcache trains
each epoch on one stored view per row (``--views K``: :func:`~featcache.probes.views.view_choice`,
seeded by the run's seed and the epoch), or on the deterministic view without ``--views``; it
selects the epoch on its val split (the dataset's, else a seeded 10% of train), never on test;
fp32 (the reference: fp16 autocast with a gradient scaler on GPU); with fewer rows than a batch,
one batch of all rows per epoch (lr scaled to it, as ``bob-linear``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.errors import NotInStoreError, ProbeError, ProtocolError
from featcache.probes.solver_registry import FitOutcome, FitRequest, epochs_option, register_solver

if TYPE_CHECKING:
    from featcache.store import FeatureCache, Features

log = logging.getLogger(__name__)

__all__ = [
    "EpOptions",
    "ep_batches",
    "fit_attentive_ep",
    "load_ep_input",
    "resolve_ep_kinds",
    "stored_ep_fingerprint",
    "train_ep",
]

#: where the reference's tokens come from, recorded beside the store's
REFERENCE_TOKENS = (
    "efficient-probing ep_all: [cls] then patch tokens (models_vit.py:313-315, models_more.py:31-34 at b8f4fb8); "
    "DINOv2 loader after the final norm, models_vit.py ViTs before it"
)
DEVIATION = (
    "the reference trains 90 epochs of batch 4096 on a fresh RandomResizedCrop of every image each epoch and "
    "keeps the best epoch on ImageNet val; featcache trains on stored views (one per row per epoch, --views K) or "
    "the deterministic view, selects the epoch on its val split (never test), in fp32"
)


# ------------------------------------------------------------------ input from the store
def resolve_ep_kinds(available: Sequence[str], kind: str = "tokens") -> tuple[str, str | None]:
    """(patch-token kind, class-token kind or None): ``kind`` (``tokens`` or ``tokens@GxG``) and
    ``cls`` where the store has it; missing patch tokens: one line naming the extract flags."""
    avail = list(available)
    if not (kind == "tokens" or kind.startswith("tokens@")):
        raise ProbeError(f"attentive:ep pools patch tokens (--kind tokens or tokens@GxG), not {kind!r}")
    if kind not in avail:
        raise NotInStoreError(
            f"attentive:ep reads the patch tokens ({kind}) and, where the backbone has one, the class token (cls); "
            f"the store has {avail}. Extract them in one pass: featcache extract ... --features cls,{kind} "
            f"(a ViT) or --features {kind} (a CNN)"
        )
    return kind, "cls" if "cls" in avail else None


def stored_ep_fingerprint(cache: FeatureCache, backbone: str, dataset: str, split: str, kind: str = "tokens") -> str:
    """:func:`load_ep_input`'s fingerprint from the provenance records alone (no read)."""
    from featcache.store import combine_fingerprints

    kinds = [k for k in resolve_ep_kinds(cache.kinds(backbone, dataset, split), kind) if k]
    return combine_fingerprints(*(cache.stored_fingerprint(backbone, dataset, split, k) for k in kinds))


def load_ep_input(cache: FeatureCache, backbone: str, dataset: str, split: str, kind: str = "tokens") -> Features:
    """The split's ``[n, 1 + T, D]`` input (class token first, as ``ep_all``), or ``[n, T, D]``
    without a stored ``cls``, in the stored dtype; ``input_info`` records the sources."""
    from featcache.store import Features, combine_fingerprints

    tok_kind, cls_kind = resolve_ep_kinds(cache.kinds(backbone, dataset, split), kind)
    ft = cache.load(backbone, dataset, split, kind=tok_kind)
    X, fp, valid = np.asarray(ft.X), ft.fingerprint, np.asarray(ft.valid, bool)
    if cls_kind is not None:
        fc = cache.load(backbone, dataset, split, kind=cls_kind)
        if not np.array_equal(np.asarray(fc.ids), np.asarray(ft.ids)):
            raise ProbeError(f"{backbone}/{dataset}/{split}: kinds cls and {tok_kind} hold different rows")
        Xc = np.asarray(fc.X)
        if Xc.shape[-1] != X.shape[-1]:
            raise ProbeError(f"{backbone}/{dataset}/{split}: cls has width {Xc.shape[-1]} but {tok_kind} {X.shape[-1]}")
        X = np.concatenate([Xc[:, None, :].astype(X.dtype), X], axis=1)
        fp, valid = combine_fingerprints(fc.fingerprint, ft.fingerprint), valid & np.asarray(fc.valid, bool)
    name = f"cls+{tok_kind}" if cls_kind else tok_kind
    out = Features(
        backbone=backbone, dataset=dataset, split=split, kind=name, X=X, labels=ft.labels, ids=ft.ids, valid=valid,
        class_names=ft.class_names, provenance=ft.provenance, dataset_fingerprint=ft.dataset_fingerprint,
        fingerprint=fp,
    )  # fmt: skip
    out.input_info = {  # type: ignore[attr-defined]
        "input": name,
        "ep_input": "ep_all ([cls] + patch tokens)" if cls_kind else "ep (patch tokens; no cls stored)",
        "tokens_norm": "featcache tokens/cls: a ViT's outputs through its final norm (timm forward_features); "
        "a CNN's final map",
        "reference_tokens": REFERENCE_TOKENS,
    }
    return out


# ------------------------------------------------------------------ training
def ep_batches(n: int, batch_size: int) -> tuple[int, int]:
    """(rows per batch, batches per epoch): the reference's ``drop_last=True`` loader, or one
    batch of all rows where there are fewer than ``batch_size``."""
    b = min(int(batch_size), int(n))
    return b, n // b


def _batch(X: Any, views: list | None, vsel: np.ndarray | None, bi: np.ndarray) -> np.ndarray:
    """Rows ``bi`` as float32: of ``X``, or of each row's view of this epoch."""
    if views is None or vsel is None:  # no views: the stored rows themselves
        return np.asarray(X[bi], np.float32)
    out = np.empty((bi.size, *X.shape[1:]), np.float32)
    for v, V in enumerate(views):
        m = vsel[bi] == v
        if m.any():
            out[m] = V[bi[m]]
    return out


def train_ep(
    X: Any, y: np.ndarray, val: tuple[Any, np.ndarray], n_classes: int, grid: Any, epochs: int, seed: int, **kw: Any
) -> tuple[Any, dict[str, Any]]:
    """Train EP's head on tokens ``X`` ``[n, S, D]`` (labels 0..n_classes-1) with the reference's
    LARS recipe for ``epochs``; keep the first epoch with the best ``val`` (X, y) score. Keywords:
    ``device`` ("cpu"), ``num_queries`` and ``batch_size`` (the grid's), ``lr`` (the grid's blr x
    batch / 256), ``views`` (``[K][n, S, D]``), ``metric``.
    Returns (best head in eval mode, info)."""
    import torch

    from featcache.core.progress import tqdm
    from featcache.probes.attentive import predict_logits, val_score
    from featcache.probes.attentive_modules import build_attentive_head
    from featcache.probes.lars import lars_optimizer, lr_at
    from featcache.probes.views import view_choice

    device, views, metric = kw.get("device", "cpu"), kw.get("views"), kw.get("metric", "top1")
    queries = int(kw.get("num_queries") or grid.num_queries)
    n, _, D = X.shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        head = build_attentive_head("ep", D, n_classes, 1, num_queries=queries).to(device)
    batch, steps = ep_batches(n, int(kw.get("batch_size") or grid.batch_size))
    lr = float(kw.get("lr") or grid.blr * batch / 256)
    warm = grid.warmup_epochs * epochs / grid.epochs  # the reference's 10 of 90, scaled with the epochs
    opt = lars_optimizer(head.parameters(), lr=lr, weight_decay=grid.weight_decay, momentum=grid.momentum,
                         trust=grid.trust_coefficient)  # fmt: skip
    gen = torch.Generator().manual_seed(int(seed))
    y_t = torch.from_numpy(np.asarray(y, np.int64))
    best, best_state, scores, finite = -np.inf, None, [], True
    bar = tqdm(total=epochs * steps, desc="attentive:ep", unit="step", disable=not kw.get("progress"))
    for epoch in range(epochs):
        vsel = None if views is None else view_choice(seed, epoch, n, len(views))
        perm = torch.randperm(n, generator=gen).numpy()
        head.train()
        bar.set_postfix_str(f"epoch {epoch + 1}/{epochs}, 1 head", refresh=False)
        for i in range(steps):
            bar.update(1)
            for g in opt.param_groups:
                g["lr"] = lr_at(i / steps + epoch, lr, epochs, warm, grid.min_lr)
            bi = perm[i * batch : (i + 1) * batch]
            xb = torch.from_numpy(_batch(X, views, vsel, bi)).to(device)
            loss = torch.nn.functional.cross_entropy(head(xb), y_t[bi].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            finite = finite and bool(torch.isfinite(loss))
        head.eval()
        P = _softmax(predict_logits([head], val[0], device)[0])
        scores.append(val_score(metric, val[1], P) if finite else -np.inf)
        if scores[-1] > best:  # main_linprobe.py:655: the first epoch with the highest val top-1
            best, best_state = scores[-1], copy.deepcopy(head.state_dict())
    bar.close()
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    params = sum(p.numel() for p in head.parameters())
    info = {"lr": lr, "batch_size": batch, "steps_per_epoch": steps, "steps": steps * epochs, "warmup_epochs": warm,
            "num_queries": queries, "parameters": params, "val_by_epoch": [float(s) if np.isfinite(s) else None for s in scores],
            "best_epoch": int(np.argmax(scores)) if scores else -1, "finite": finite and best_state is not None}  # fmt: skip
    return head, info


def _softmax(Z: np.ndarray) -> np.ndarray:
    from scipy.special import softmax

    return softmax(Z, axis=1)


# ------------------------------------------------------------------ solver
@dataclass(frozen=True)
class EpOptions:
    """``attentive:ep``'s options: epochs, queries, batch and lr; ``None``: the protocol grid's (90,
    32, 4096, 0.1 x batch / 256). Another protocol refuses the ``--ep-*`` flags (``exclusive``)."""

    exclusive: ClassVar[tuple[str, ...]] = ("ep_queries", "ep_batch_size", "ep_lr")

    sgd_epochs: int | None = epochs_option()
    ep_queries: int | None = flag(
        None, "attentive:ep: learned queries (reference: 32; the token width must divide by it)", type=int,
        check=Interval(int, 1),
    )  # fmt: skip
    ep_batch_size: int | None = flag(
        None, "attentive:ep: rows per batch, lr = 0.1 x batch / 256 (reference: 4096, lr 1.6)", type=int,
        check=Interval(int, 2),
    )  # fmt: skip

    ep_lr: float | None = flag(
        None, "attentive:ep: absolute lr (default: 0.1 x batch / 256, the reference's rule: 1.6 at 4096)",
        type=float, check=Interval(float, 0),
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self)

    def resolve(self, proto: Any) -> EpOptions:
        """The grid's epochs and queries where not given."""
        g = proto.grid
        return dataclasses.replace(
            self,
            sgd_epochs=getattr(g, "epochs", None) if self.sgd_epochs is None else self.sgd_epochs,
            ep_queries=getattr(g, "num_queries", None) if self.ep_queries is None else self.ep_queries,
            ep_batch_size=getattr(g, "batch_size", None) if self.ep_batch_size is None else self.ep_batch_size,
        )


def _accepts(proto: Any) -> None:
    """Only a protocol with an :class:`~featcache.core.protocols.EpGrid` (``attentive:ep``)."""
    from featcache.core.protocols import EpGrid

    if not isinstance(proto.grid, EpGrid):
        raise ProtocolError(f"the attentive-ep solver runs attentive:ep's EpGrid; {proto.spec} has {proto.grid!r}")


@register_solver(
    "attentive-ep",
    options=EpOptions,
    views=True,
    load=load_ep_input,
    input_fingerprint=stored_ep_fingerprint,
    accepts=_accepts,
)
def fit_attentive_ep(req: FitRequest) -> FitOutcome:
    """Train EP's head on the plan's train rows (views when given), keep its best epoch on the
    val rows, report that head (no refit)."""
    from featcache.probes.attentive import predict_logits
    from featcache.probes.attentive_modules import ATTENTIVE_VARIANTS, vjepa_parameter_count
    from featcache.probes.logistic import cpu_threads, resolve_backend

    g, (Xtr, ytr), (Xva, yva) = req.proto.grid, req.plan.tr, req.plan.va
    if np.ndim(Xtr) != 3 or np.ndim(Xva) != 3 or Xtr.shape[1:] != Xva.shape[1:]:
        raise ProbeError(f"attentive:ep takes [n, S, D] tokens of one shape; got {Xtr.shape} and {Xva.shape}")
    if not len(yva):
        raise ProbeError("attentive:ep chooses its epoch on validation rows and the plan has none")
    classes = np.unique(np.concatenate([ytr, yva]))
    epochs, device = int(req.opts["sgd_epochs"]), resolve_backend("torch")[1]
    views = list(req.plan.views["tr"]) if getattr(req.plan, "views", None) else None
    t0 = time.perf_counter()
    with cpu_threads(device):
        head, info = train_ep(
            Xtr, np.searchsorted(classes, ytr), (Xva, np.searchsorted(classes, yva)), classes.size, g, epochs,
            req.seed, device=device, num_queries=req.opts.get("ep_queries"), views=views,
            batch_size=req.opts.get("ep_batch_size"), lr=req.opts.get("ep_lr"),
            metric=req.opts.get("metric", "top1"), progress=req.opts.get("progress", False),
        )  # fmt: skip
    D = Xtr.shape[-1]
    log.info("attentive:ep: %d parameters (attentive:vjepa's head at width %d: %d); best epoch %d of %d",
             info["parameters"], D, vjepa_parameter_count(D, classes.size), info["best_epoch"] + 1, epochs)  # fmt: skip
    hp = {
        "solver": "attentive-ep", "variant": "ep", "module": ATTENTIVE_VARIANTS.entry("ep").note, "device": device,
        "selection": "best epoch on val (first of the highest); no refit", **info,
        "vjepa_parameters": vjepa_parameter_count(D, classes.size), "epochs": epochs, "blr": g.blr,
        "optimizer": f"LARS(momentum={g.momentum}, trust={g.trust_coefficient}, weight_decay={g.weight_decay})",
        "lr_schedule": "per iteration: linear warmup then half-cycle cosine to min_lr (MAE lr_sched)",
        "precision": "fp32", "deviation": DEVIATION,
        "views": len(views) if views else 0,
    }  # fmt: skip
    if epochs != g.epochs or info["batch_size"] != g.batch_size or req.opts.get("ep_lr") is not None:
        hp.update(scaled=True, scaled_from={"epochs": g.epochs, "warmup_epochs": g.warmup_epochs,
                                            "batch_size": g.batch_size})  # fmt: skip

    def predict(Xe: np.ndarray) -> np.ndarray:
        with cpu_threads(device):
            return _softmax(predict_logits([head], Xe, device)[0])

    return FitOutcome(predict, classes, hp, bool(info["finite"]), time.perf_counter() - t0)
