"""Attentive probes on cached tokens (``attentive:vjepa``, ``attentive:aim``): a grid of heads
trained together in one pass over the tokens, the best head chosen on validation.

Each head is the reference module of its variant (:mod:`featcache.probes.attentive_modules`)
trained with V-JEPA's frozen-evaluation recipe (facebookresearch/jepa at 51c59d5,
``evals/image_classification_frozen/eval.py`` ``init_opt`` / ``run_one_epoch`` and
``src/utils/schedulers.py``): AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) with two
parameter groups, weight decay on every parameter except biases and 1-D ones; before every
step the lr follows ``WarmupCosineSchedule`` (no warmup: the head's lr, cosine to 0 over all
steps) and the weight decay ``CosineWDSchedule`` (the head's wd, cosine to 1e-6); cross-entropy,
``clip_grad_norm_(head.parameters(), 1.0)``, step. The grid is V-JEPA 2's image-probe grid
(facebookresearch/vjepa2 ``configs/eval/vitl/in1k.yaml``: lr {5e-4, 1e-3, 1.5e-3, 2e-3} x wd
{5e-4, 1e-3, 2e-3, 4e-3, 8e-3}, 20 heads). Every head sees the same batches: each block of
token rows is read once per epoch and each batch feeds every head (one backward over the sum
of the heads' losses, one AdamW step over every head's groups).

Batches: each epoch visits the rows in blocks of ``shuffle_block_rows`` consecutive rows, the
block order and the rows inside each block permuted (seeded ``torch.Generator``), batches of
``batch_size`` cut inside a block (the last one may be partial). The block is the unit a
streamed split is read in, so a split read from the store block by block trains on exactly
the batches of the same split held in memory. Validation and test logits are computed block by
block too.

Precision: bf16 autocast where the device computes bf16 fast (CUDA; a CPU with AMX, as
:func:`featcache.core.cpu.bf16_flags` says) and the freshly built heads' logits under bf16 agree
with fp32 on the first training batch (every row's cosine >= :data:`BF16_MIN_COSINE`); else
fp32. The choice and the check are recorded in the results row's hparams.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from featcache.core.configs import check_fields
from featcache.errors import ProbeError, ProtocolError
from featcache.probes.attentive_modules import attention_heads, build_attentive_head
from featcache.probes.head_grid import GridOutcome as _Outcome
from featcache.probes.head_grid import grid_schedule_option, halving_eta_option, max_memory_option
from featcache.probes.solver_registry import FitOutcome, FitRequest, epochs_option, register_solver

log = logging.getLogger(__name__)

__all__ = [
    "BF16_MIN_COSINE",
    "cosine_wd",
    "fit_attentive",
    "grid_step",
    "param_groups",
    "predict_logits",
    "shuffle_block_rows",
    "train_attentive_grid",
    "val_score",
    "warmup_cosine_lr",
]

#: the bf16 agreement bound (the extract stage's ``--precision auto`` bound)
BF16_MIN_COSINE = 0.98
#: float32 bytes of one shuffle/read block of token rows
BLOCK_BYTES = 256 << 20
#: batch rows of a prediction pass
PREDICT_ROWS = 1024


def warmup_cosine_lr(
    step: int, warmup_steps: int, start_lr: float, ref_lr: float, final_lr: float, t_max: int
) -> float:
    """jepa ``WarmupCosineSchedule.step`` at its ``step``-th call (``t_max``: all steps)."""
    if step < warmup_steps:
        return start_lr + step / max(1, warmup_steps) * (ref_lr - start_lr)
    progress = (step - warmup_steps) / max(1, t_max - warmup_steps)
    return max(final_lr, final_lr + (ref_lr - final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_wd(step: int, ref_wd: float, final_wd: float, t_max: int) -> float:
    """jepa ``CosineWDSchedule.step`` at its ``step``-th call."""
    progress = step / t_max
    wd = final_wd + (ref_wd - final_wd) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(final_wd, wd) if final_wd <= ref_wd else min(final_wd, wd)


def param_groups(head: Any, lr: float = 0.0) -> list[dict[str, Any]]:
    """V-JEPA's ``init_opt`` groups of one head: decayed (neither bias nor 1-D), then excluded."""
    named = list(head.named_parameters())
    return [
        {"params": [p for n, p in named if "bias" not in n and p.ndim != 1], "lr": lr},
        {
            "params": [p for n, p in named if "bias" in n or p.ndim == 1],
            "lr": lr,
            "WD_exclude": True,
            "weight_decay": 0,
        },
    ]


def shuffle_block_rows(n: int, row_bytes: int, batch_size: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Rows of one shuffle/read block: a whole number of batches within ``block_bytes`` of
    float32 rows (at least one batch), at most all ``n`` rows."""
    batches = max(1, block_bytes // max(1, row_bytes * batch_size))
    return int(min(n, batches * batch_size))


def _epoch_blocks(n: int, rows: int, gen: Any) -> list[tuple[int, int, Any]]:
    """One epoch's (start, end, row permutation) blocks, in their permuted order."""
    import torch

    starts = list(range(0, n, rows))
    order = torch.randperm(len(starts), generator=gen).tolist()
    out = []
    for i in order:
        a = starts[i]
        b = min(n, a + rows)
        out.append((a, b, torch.randperm(b - a, generator=gen)))
    return out


def _read(X: Any, a: int, b: int) -> np.ndarray:
    """Rows ``a:b`` of an in-memory array or a store view, as float32."""
    return np.asarray(X[a:b], dtype=np.float32)


def _blocks(X: Any, spans: list[tuple[int, int, Any]]) -> Iterator[tuple[np.ndarray, Any]]:
    """The blocks of ``spans`` read in order, the next one read in a thread while the
    caller trains on the current one."""
    if not spans:
        return
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_read, X, spans[0][0], spans[0][1])
        for i, (_, _, perm) in enumerate(spans):
            block = fut.result()
            if i + 1 < len(spans):
                fut = pool.submit(_read, X, spans[i + 1][0], spans[i + 1][1])
            yield block, perm


def _amp_check(heads: list, xb: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """(autocast dtype or None, record): bf16 where the device has it and the heads agree."""
    import torch

    from featcache.probes._precision import bf16_choice

    for h in heads:
        h.eval()
    return bf16_choice(device, lambda: torch.stack([h(xb) for h in heads]), BF16_MIN_COSINE)


def _grid_heads(variant: str, dim: int, n_classes: int, n_heads: int, seed: int, keep: Any = None) -> list:
    """``n_heads`` fresh heads drawn in turn from torch's stream seeded with ``seed`` (the
    process's stream is restored afterwards); ``keep``: only those indices are kept (every head
    is still drawn, so each one's weights do not depend on which are kept)."""
    import torch

    want = range(n_heads) if keep is None else set(keep)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        out = []
        for i in range(n_heads):
            h = build_attentive_head(variant, dim, n_classes, attention_heads(dim))
            if i in want:
                out.append(h)
        return out


def train_attentive_grid(
    X: Any,
    y: np.ndarray,
    n_classes: int,
    grid: Any,
    epochs: int,
    seed: int,
    device: str = "cpu",
    amp: str = "auto",
    *,
    sched: Any = None,
    val: Any = None,
    keep: str = "all",
) -> tuple[list, dict[str, Any]]:
    """Train ``grid``'s lr x wd heads of ``grid.variant`` on tokens ``X`` ``[n, T, D]`` (an
    array or a store view, read block by block) with labels ``y`` (0..n_classes-1).
    ``amp``: ``auto`` (see the module docstring) or ``fp32``. ``sched``: a
    :class:`~featcache.probes.head_grid.GridPlan` (schedule, eta, memory bound; default the
    full grid in one group); ``val``: ``(X_val, y_val, metric)`` the heads are scored on (halving
    needs it); ``keep``: ``all`` returns every finished head, ``best`` only the selected one
    (the others ``None``). Returns (heads, info)."""
    from featcache.probes.attentive_grid import attentive_grid

    return attentive_grid(sys.modules[__name__], X, y, n_classes, grid, epochs, seed, device, amp, sched, val, keep)


def grid_step(heads: list, opt: Any, xb: Any, yb: Any, clip: float, dtype: Any = None) -> list[bool]:
    """One optimisation step of every head on batch ``(xb, yb)``: cross-entropy, each head's
    backward in turn (its gradient is that of the heads' summed losses, and only one head's
    activations are held at a time), each head's gradient norm clipped to ``clip``, the AdamW
    step (``opt``: one optimiser over every head's groups, or one per head; lr / wd already
    set). Returns each head's loss finiteness."""
    import torch

    dev = xb.device.type
    losses = []
    for h in heads:
        with torch.autocast(dev, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(h(xb).float(), yb)
        loss.backward()
        losses.append(loss.detach())
    for h in heads:
        torch.nn.utils.clip_grad_norm_(h.parameters(), clip)
    for o in opt if isinstance(opt, list) else [opt]:
        o.step()
        o.zero_grad(set_to_none=True)
    return [bool(torch.isfinite(loss)) for loss in losses]


def set_schedules(opts: list, combos: list, grid: Any, step: int, warm: int, t_max: int) -> None:
    """Each head's optimiser groups (``opts[k]``: head ``k``'s two groups) at the schedules'
    ``step``-th call, from that head's (lr, wd) in ``combos``."""
    for o, (lr, wd) in zip(opts, combos):
        start = grid.start_lr if grid.start_lr is not None else lr
        new_lr = warmup_cosine_lr(step, warm, start, lr, grid.final_lr, t_max)
        new_wd = cosine_wd(step, wd, grid.final_wd, t_max)
        for g in o.param_groups:
            g["lr"] = new_lr
            if not g.get("WD_exclude"):
                g["weight_decay"] = new_wd


def predict_logits(heads: list, X: Any, device: str, dtype: Any = None, rows: int = PREDICT_ROWS) -> np.ndarray:
    """Logits ``[H, n, K]`` (float64) of ``heads`` (eval mode) on tokens ``X``, block by block."""
    import torch

    n = X.shape[0]
    out = None
    with torch.no_grad():
        for a in range(0, n, rows):
            xb = torch.from_numpy(_read(X, a, min(n, a + rows))).to(device)
            with torch.autocast(device.split(":")[0], dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                z = torch.stack([h(xb).float() for h in heads]).double().cpu().numpy()
            if out is None:
                out = np.empty((len(heads), n, z.shape[-1]))
            out[:, a : a + len(xb)] = z
    if out is None:
        raise ProbeError("no rows to predict")
    return out


def _check_tokens(X: Any, spec: str) -> None:
    if len(getattr(X, "shape", ())) != 3:
        raise ProbeError(
            f"{spec} pools token features [n, T, D] but got an array of shape {tuple(X.shape)}; "
            "extract them with `featcache extract ... --features tokens` (or tokens@GxG for large "
            "datasets) and probe with --kind tokens"
        )


def _accepts(proto: Any) -> None:
    """The protocol's head variant is one this module builds (one line naming the registered)."""
    from featcache.probes.attentive_modules import ATTENTIVE_VARIANTS

    if proto.grid.variant not in ATTENTIVE_VARIANTS:
        raise ProtocolError(
            ATTENTIVE_VARIANTS.unknown(proto.grid.variant, what=f"{proto.spec}: no attentive head", known="built:")
        )


@dataclass(frozen=True)
class AttentiveOptions:
    """``attentive:*``'s options: its epochs, the grid schedule and the memory bound
    (:mod:`featcache.probes.head_grid`). A protocol without a head grid (``full``,
    ``attentive:ep``'s one head) refuses the grid flags instead of ignoring them (``exclusive``)."""

    exclusive: ClassVar[tuple[str, ...]] = ("grid_schedule", "halving_eta", "max_memory")

    sgd_epochs: int | None = epochs_option()
    grid_schedule: str = grid_schedule_option()
    halving_eta: int = halving_eta_option()
    max_memory: str | None = max_memory_option()

    def __post_init__(self) -> None:
        check_fields(self)

    def resolve(self, proto: Any) -> AttentiveOptions:
        """The protocol grid's epochs unless given."""
        if self.sgd_epochs is not None:
            return self
        return replace(self, sgd_epochs=getattr(proto.grid, "epochs", None))


@register_solver(
    "attentive",
    options=AttentiveOptions,
    streams=True,
    accepts=_accepts,
    run_options=("sgd_epochs", "grid_schedule", "halving_eta"),
)
def fit_attentive(req: FitRequest) -> FitOutcome:
    """Train the protocol's head grid on the plan's train rows (all heads, or successive
    halving), choose the best head on its validation rows (the task metric), report that head
    (no refit)."""
    from scipy.special import softmax

    from featcache.core.devices import resolve_device
    from featcache.probes.head_grid import GridPlan
    from featcache.probes.logistic import cpu_threads

    g, (Xtr, ytr), (Xva, yva) = req.proto.grid, req.plan.tr, req.plan.va
    epochs = req.opts["sgd_epochs"] or g.epochs
    for X in (Xtr, Xva):
        _check_tokens(X, req.proto.spec)
    if not len(yva):
        raise ProbeError(f"{req.proto.spec} chooses its head on validation rows and the plan has none")
    classes = np.unique(np.concatenate([ytr, yva]))
    device = resolve_device("auto")
    metric = req.opts.get("metric", "top1")
    plan = GridPlan.from_opts(req.opts, req.proto.spec)
    t0 = time.perf_counter()
    with cpu_threads(device):
        heads, info = train_attentive_grid(
            Xtr, np.searchsorted(classes, ytr), classes.size, g, epochs, req.seed, device,
            sched=plan, val=(Xva, np.searchsorted(classes, yva), metric), keep="best",
        )  # fmt: skip
    run = info["grid"]
    scores = [-np.inf if v != v else v for v in run["val"]]
    best = run["best"]
    lr, wd = info["combos"][best]
    hp = _hparams(g, epochs, device, info, scores, metric, best)
    hp.update(plan.record(_Outcome(**run)))
    if plan.schedule != "full":
        hp["selection"] = (
            f"best of the heads trained to the end by successive halving (eta {plan.eta}) on val {metric}; no refit"
        )
        for h, st in zip(hp["heads"], run["status"]):
            h["status"] = st
    hp["tokens_read"] = "in memory" if isinstance(Xtr, np.ndarray) else "from the store, block by block"
    best_head = heads[best]

    def predict(Xe: np.ndarray) -> np.ndarray:
        with cpu_threads(device):
            return softmax(predict_logits([best_head], Xe, device, info["amp_dtype"])[0], axis=1)

    log.info(
        "%s: best head lr=%g wd=%g (val %s %.4f of %d heads)", req.proto.spec, lr, wd, metric, scores[best], len(heads)
    )
    return FitOutcome(predict, classes, hp, bool(info["finite"][best]), time.perf_counter() - t0)


def val_score(metric: str, y: np.ndarray, P: np.ndarray) -> float:
    """A head's validation score: the task metric of its probabilities (top-1 by default)."""
    if metric == "top1":
        return float(np.mean(P.argmax(1) == y))
    from featcache.core.metrics import METRICS

    return float(METRICS[metric](y, P))


def _hparams(g: Any, epochs: int, device: str, info: dict, scores: list, metric: str, best: int) -> dict[str, Any]:
    """The results row's record of one grid fit."""
    from featcache.probes.attentive_modules import ATTENTIVE_VARIANTS

    lr, wd = info["combos"][best]
    hp = {
        "solver": "attentive",
        "variant": g.variant,
        "module": ATTENTIVE_VARIANTS.entry(g.variant).note,
        "device": device,
        "selection": f"best of {len(scores)} heads (lr x wd) on val {metric}; no refit",
        "lr": lr,
        "weight_decay": wd,
        "heads": [
            {"lr": c[0], "weight_decay": c[1], "val": float(s) if np.isfinite(s) else None}
            for c, s in zip(info["combos"], scores)
        ],
        "epochs": epochs,
        "optimizer": "AdamW(betas=(0.9, 0.999), eps=1e-8), no decay on biases and 1-D parameters",
        "lr_schedule": f"warmup {g.warmup_epochs} epochs then cosine to {g.final_lr}",
        "wd_schedule": f"cosine to {g.final_wd}",
        "grad_clip": g.clip,
        **{k: info[k] for k in ("batch_size", "steps_per_epoch", "steps", "shuffle_block_rows", "attention_heads")},
        "precision": info["amp"],
    }
    if epochs != g.epochs:
        hp.update(scaled=True, scaled_from={"epochs": g.epochs})
    return hp
