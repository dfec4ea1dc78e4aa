"""Battle of the Backbones' linear probe (``bob-linear``) on cached features.

bob-classification's ``linear_probe.py`` (after MAE's ``main_linprobe.py``): the features
pass a ``BatchNorm1d(affine=False, eps=1e-6)`` (batch statistics while training, running
statistics at evaluation) into a linear head (weight ``trunc_normal_(std=0.01)``, bias
zero); cross-entropy, the LARS optimiser of MoCo v3 / MAE (momentum 0.9, trust coefficient
0.001, no weight decay, neither scaling nor decay for 1-D parameters), lr = blr x batch /
256 with blr 0.1, a linear warmup over 10 epochs then a half-cycle cosine to 0, set at every
iteration (MAE's ``lr_sched.adjust_learning_rate`` at ``step / len(loader) + epoch``), 90
epochs of batches of 512 with the last partial batch dropped (``drop_last=True``; with fewer
than 512 rows that trains nothing, so featcache trains one batch of all rows per epoch and
says so in ``hparams.differs_from_bob``). No
hyper-parameter is selected. BoB reports the best test accuracy over the 90 epochs;
featcache reports the last epoch (it never selects on the test split).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.errors import ProbeError
from featcache.probes.solver_registry import EpochsOptions, FitOutcome, FitRequest, register_solver

if TYPE_CHECKING:
    import torch

__all__ = ["fit_bob_linear", "lars_optimizer", "lr_at", "small_train_note"]


@functools.cache
def _lars_class():
    import torch

    class Lars(torch.optim.Optimizer):
        """LARS (You et al.) as MoCo v3 and MAE use it: for parameters with more than one
        dimension the update ``grad + weight_decay * p`` is scaled by ``trust * |p| / |update|``
        (1 where either norm is 0); 1-D parameters (bias, norm) take the plain gradient; then
        heavy-ball momentum ``mu = momentum * mu + update``, ``p -= lr * mu``."""

        def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9, trust=0.001):
            super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "trust": trust})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    update = p.grad
                    if p.ndim > 1:
                        update = update.add(p, alpha=group["weight_decay"])
                        pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                        ratio = torch.where((pn > 0) & (un > 0), group["trust"] * pn / un, torch.ones_like(pn))
                        update = update * ratio
                    state = self.state[p]
                    if "mu" not in state:
                        state["mu"] = torch.zeros_like(p)
                    state["mu"].mul_(group["momentum"]).add_(update)
                    p.add_(state["mu"], alpha=-group["lr"])

    return Lars


def lars_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float = 0.0,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    trust: float = 0.001,
) -> torch.optim.Optimizer:
    """A :class:`Lars` torch optimiser over ``params`` (torch is imported on first use)."""
    return _lars_class()(params, lr=lr, weight_decay=weight_decay, momentum=momentum, trust=trust)


def lr_at(epoch: float, lr: float, epochs: int, warmup_epochs: int, min_lr: float = 0.0) -> float:
    """MAE's ``adjust_learning_rate``: linear warmup to ``lr`` over ``warmup_epochs``, then a
    half-cycle cosine to ``min_lr`` at ``epochs`` (``epoch`` fractional)."""
    if epoch < warmup_epochs:
        return lr * epoch / warmup_epochs
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / (epochs - warmup_epochs)))


def small_train_note(n: int, batch_size: int) -> str:
    """What featcache does where BoB's loader would give no batch (``n < batch_size``)."""
    return (
        f"train has {n} rows < batch {batch_size}: BoB's DataLoader(drop_last=True) has 0 batches, so "
        f"its head would stay at its initialisation (0 steps); featcache trains on one batch of all {n} "
        f"rows per epoch instead, lr = blr x {n} / 256"
    )


def train_bob_head(X: np.ndarray, y: np.ndarray, n_classes: int, grid, epochs: int, seed: int, device: str, views=None):
    """Train BN + linear head; returns (predict_logits, info) with the BN in eval mode.

    ``views`` (``[K, n, D]``, the rows' augmented views): each epoch trains on the view of
    each row that :func:`~featcache.probes.views.view_choice` draws for (seed, epoch)."""
    import torch

    from featcache.probes.views import view_choice

    gen = torch.Generator().manual_seed(int(seed))
    X_t = torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(device)
    y_t = torch.from_numpy(np.asarray(y, np.int64)).to(device)
    n, D = X_t.shape
    V_t = None if views is None else torch.from_numpy(np.ascontiguousarray(views, np.float32)).to(device)
    rows = torch.arange(n, device=device)
    batch = min(grid.batch_size, n)  # drop_last with fewer rows than a batch would train nothing: recorded
    per_epoch = n // batch
    lr = grid.blr * batch / 256
    bn = torch.nn.BatchNorm1d(D, affine=False, eps=grid.bn_eps).to(device)
    head = torch.nn.Linear(D, n_classes).to(device)
    with torch.no_grad():
        w = torch.empty(n_classes, D)
        torch.nn.init.trunc_normal_(w, std=0.01, generator=gen)
        head.weight.copy_(w)
        head.bias.zero_()
    opt = lars_optimizer(
        head.parameters(), lr=lr, weight_decay=grid.weight_decay, momentum=grid.momentum, trust=grid.trust_coefficient
    )
    finite = True
    bn.train()
    for epoch in range(epochs):
        if V_t is not None:  # this epoch's view of every row
            X_t = V_t[torch.from_numpy(view_choice(seed, epoch, n, V_t.shape[0])).to(device), rows]
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(per_epoch):
            for g in opt.param_groups:
                g["lr"] = lr_at(i / per_epoch + epoch, lr, epochs, grid.warmup_epochs, grid.min_lr)
            bi = perm[i * batch : (i + 1) * batch]
            loss = torch.nn.functional.cross_entropy(head(bn(X_t[bi])), y_t[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if not torch.isfinite(loss):
            finite = False
            break
    bn.eval()

    def logits(Xe: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            Z = head(bn(torch.from_numpy(np.ascontiguousarray(Xe, np.float32)).to(device)))
        return Z.double().cpu().numpy()

    info: dict[str, Any] = {"lr": lr, "batch_size": batch, "steps_per_epoch": per_epoch, "steps": per_epoch * epochs}
    if n < grid.batch_size:  # BoB's DataLoader(drop_last=True) has no batch at all
        info["differs_from_bob"] = small_train_note(n, grid.batch_size)
    return logits, info, finite and bool(torch.isfinite(head.weight).all())


@register_solver("lars", options=EpochsOptions, views=True)
def fit_bob_linear(req: FitRequest) -> FitOutcome:
    """Train BoB's BN + linear head with LARS on the plan's final rows (nothing is selected)."""
    from scipy.special import softmax

    from featcache.probes.logistic import cpu_threads, resolve_backend

    g, (X, y), epochs = req.proto.grid, req.plan.fin, req.opts["sgd_epochs"]
    if epochs < 1:
        raise ProbeError(f"bob-linear needs epochs >= 1 (got {epochs}); pass --epochs N (epochs=N in Python)")
    classes = np.unique(y)
    device = resolve_backend("torch")[1]
    t0 = time.perf_counter()
    views = None
    if req.plan.views:  # --views K: one view per row per epoch, seeded
        views = np.stack([np.asarray(v, np.float32) for v in req.plan.views["fin"]])
    with cpu_threads(device):
        logits, info, ok = train_bob_head(
            np.asarray(X), np.searchsorted(classes, y), classes.size, g, epochs, req.seed, device, views
        )
    hp = {
        "solver": "lars",
        "device": device,
        "selection": "none (fixed hyper-parameters, as BoB)",
        "report": "last epoch (BoB reports the best test epoch)",
        "blr": g.blr,
        **info,
        "epochs": epochs,
        "warmup_epochs": g.warmup_epochs,
        "min_lr": g.min_lr,
        "weight_decay": g.weight_decay,
        "momentum": g.momentum,
        "trust_coefficient": g.trust_coefficient,
        "features": f"batchnorm(affine=False, eps={g.bn_eps})",
    }
    if epochs != g.epochs:
        hp.update(scaled=True, scaled_from={"epochs": g.epochs})
    if views is not None:
        hp.update(views=len(views), view_draw="one view per row per epoch (probes.views.view_choice(seed, epoch))")
    return FitOutcome(lambda Xe: softmax(logits(Xe), axis=1), classes, hp, ok, time.perf_counter() - t0)
