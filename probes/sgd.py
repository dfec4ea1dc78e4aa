"""Mini-batch SGD training of a linear head (Salman et al.; VTAB lightweight schedule):
:class:`SGDProbe`, a scikit-learn classifier, over :func:`train_sgd_head`.

The loss is the mean softmax cross-entropy of the batch (``loss="bce"``: the mean binary
cross-entropy with logits of an [n, K] 0/1 target matrix, ELEVATER's multi-label head); weight decay (torch SGD's, on W
and b) and momentum as given; the learning rate is multiplied by 0.1 at each milestone
step. Shuffling uses a torch generator seeded by ``seed``, so runs repeat bit for bit on
the same device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator, ClassifierMixin

from featcache.errors import ProbeError
from featcache.probes._estimator import (
    SoftmaxPredictMixin,
    validate_fit_data,
)
from featcache.probes.logistic import Scaler, cpu_threads, resolve_backend

log = logging.getLogger(__name__)


def train_sgd_head(
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    *,
    lr: float,
    steps: int,
    batch_size: int,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    milestones: Sequence[int] = (),
    seed: int = 0,
    device: str = "cpu",
    init: tuple[np.ndarray, np.ndarray] | str | None = None,
    drop_remainder: bool = False,
    nesterov: bool = False,
    on_epoch=None,
    loss: str = "ce",
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Train ``logits = X @ W + b`` for ``steps`` updates; returns (W [D, K], b [K], finite).

    Default: batches walk through seeded epoch permutations (the last batch of an epoch may
    be smaller, as a PyTorch DataLoader), so ``steps = epochs * ceil(n / batch_size)`` is
    exactly ``epochs`` epochs. ``drop_remainder``: every batch is full, cut from the stream
    of seeded epoch permutations of :func:`featcache.core.splits.batch_positions` (VTAB's
    ``repeat`` + ``batch(drop_remainder=True)``; the batches featcache's fine-tuning uses).
    ``finite`` is False when the loss diverged (the head is then unusable). ``on_epoch(W, b)``,
    when given, is called with the head after each full epoch (ELEVATER scores every epoch).
    ``init``: ``(W, b)``, ``None`` (zeros) or ``"torch-default"``: PyTorch's default
    ``nn.Linear(D, K)`` initialisation drawn after ``torch.manual_seed(seed)`` (Salman et al.'s
    ``fine_tunify.py``), without touching the process's random state. ``loss``: ``"ce"``
    (``y`` class indices [n]) or ``"bce"`` (``y`` an [n, K] 0/1 matrix; ``BCEWithLogitsLoss``).
    """
    import torch

    if loss not in ("ce", "bce"):
        raise ProbeError(f"loss must be 'ce' or 'bce', got {loss!r}")
    bce = loss == "bce"
    criterion = torch.nn.functional.binary_cross_entropy_with_logits if bce else torch.nn.functional.cross_entropy
    gen = torch.Generator().manual_seed(int(seed))
    X_t = torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(device)
    y_t = torch.from_numpy(np.asarray(y, np.float32 if bce else np.int64)).to(device)
    n, D = X_t.shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        lin = torch.nn.Linear(D, n_classes)  # the default init, seeded, on the CPU generator
    lin = lin.to(device)
    with torch.no_grad():
        if isinstance(init, str):
            if init != "torch-default":
                raise ProbeError(f"init must be (W, b), None or 'torch-default', got {init!r}")
        elif init is None:
            lin.weight.zero_()
            lin.bias.zero_()
        else:
            lin.weight.copy_(torch.as_tensor(np.asarray(init[0]).T, dtype=torch.float32))
            lin.bias.copy_(torch.as_tensor(np.asarray(init[1]), dtype=torch.float32))
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=sorted(set(milestones)), gamma=0.1)
    step = 0
    finite = True
    for batches in _epochs(n, batch_size, steps, seed, gen, drop_remainder):
        for bi in batches:
            bi = bi.to(device)
            value = criterion(lin(X_t[bi]), y_t[bi])
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            sched.step()
            step += 1
        if not torch.isfinite(value):
            finite = False
            log.warning("SGD head diverged at step %d (lr=%g)", step, lr)
            break
        if on_epoch is not None:
            on_epoch(lin.weight.detach().double().cpu().numpy().T, lin.bias.detach().double().cpu().numpy())
    W = lin.weight.detach().double().cpu().numpy().T
    b = lin.bias.detach().double().cpu().numpy()
    return W, b, finite and bool(np.isfinite(W).all())


def _epochs(n: int, batch_size: int, steps: int, seed: int, gen, drop_remainder: bool):
    """Yield each epoch's list of batch index tensors until ``steps`` batches in all (with
    ``drop_remainder``: chunks of ``ceil(n / batch_size)`` full batches of the stream)."""
    import torch

    done = 0
    while done < steps:
        if drop_remainder:
            from featcache.core.splits import batch_positions

            k = min(max(1, -(-n // batch_size)), steps - done)
            out = [torch.from_numpy(batch_positions(n, batch_size, seed, done + i)) for i in range(k)]
        else:
            perm = torch.randperm(n, generator=gen)
            out = [perm[s : s + batch_size] for s in range(0, n, batch_size)][: steps - done]
        done += len(out)
        yield out


class SGDProbe(SoftmaxPredictMixin, ClassifierMixin, BaseEstimator):
    """Softmax linear head trained by mini-batch SGD on frozen features (scikit-learn classifier).

    Parameters
    ----------
    lr, steps, batch_size, momentum, weight_decay, milestones : the schedule of
        :func:`train_sgd_head` (``steps`` updates; lr x 0.1 at each milestone step).
    standardize : z-score features with the training mean/std (folded into ``coef_``).
    head_init : optional [K, D] raw-feature-space class-embedding matrix (rows in the order
        of ``classes_``) the head starts from; default zeros.
    random_state : seed of the batch order (runs repeat bit for bit on one device).
    drop_remainder : every batch full, from :func:`featcache.core.splits.batch_positions`
        (VTAB; fine-tuning's batches); default: per-epoch permutations with a partial last batch.
    nesterov : Nesterov momentum (ELEVATER's config default, off in its shipped model configs).
    init : the head's start when ``head_init`` is not given: ``"zeros"`` (default) or
        ``"torch-default"`` (``nn.Linear``'s default initialisation seeded by ``random_state``,
        in the space the head is trained in).
    epoch_callback : optional ``f(coef [K, D], intercept [K])`` called after each epoch with
        the head in raw-feature space (ELEVATER scores every epoch on its val rows).
    device : ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``.

    Attributes
    ----------
    classes_, n_features_in_, coef_ [K, D] (softmax layout, two rows for two classes),
    intercept_ [K], finite_ (False when the loss diverged: the head is unusable), device_.
    """

    def __init__(
        self,
        lr: float = 0.1,
        steps: int = 200,
        batch_size: int = 64,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        milestones: Sequence[int] = (),
        standardize: bool = True,
        head_init: ArrayLike | None = None,
        random_state: int = 0,
        device: str = "auto",
        drop_remainder: bool = False,
        nesterov: bool = False,
        epoch_callback: Callable[[np.ndarray, np.ndarray], object] | None = None,
        init: str = "zeros",
    ) -> None:
        self.lr = lr
        self.steps = steps
        self.batch_size = batch_size
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.milestones = milestones
        self.standardize = standardize
        self.head_init = head_init
        self.random_state = random_state
        self.device = device
        self.drop_remainder = drop_remainder
        self.nesterov = nesterov
        self.epoch_callback = epoch_callback
        self.init = init

    def fit(self, X: ArrayLike, y: ArrayLike, *, classes: ArrayLike | None = None) -> SGDProbe:
        """Fit on ``X [n, D]`` and labels ``y``; ``classes`` (default: those in ``y``) fixes
        the head's classes when ``y`` may lack some of them (e.g. a refit split)."""
        if not (self.lr > 0 and self.steps >= 0 and self.batch_size >= 1):
            raise ProbeError(
                f"SGDProbe needs lr > 0, steps >= 0, batch_size >= 1; got lr={self.lr}, "
                f"steps={self.steps}, batch_size={self.batch_size}"
            )
        X, yi, seen = validate_fit_data(self, X, y)
        classes, yi = _with_classes(seen, yi, classes)
        self.classes_ = classes
        K = classes.size
        self.device_ = resolve_backend("torch")[1] if self.device == "auto" else self.device
        scaler = Scaler.fit(X, self.standardize)
        if self.init not in ("zeros", "torch-default"):
            raise ProbeError(f"SGDProbe init must be 'zeros' or 'torch-default', got {self.init!r}")
        init = None if self.init == "zeros" else self.init
        if self.head_init is not None:
            head = np.asarray(self.head_init, np.float64)
            if head.ndim != 2 or head.shape != (K, X.shape[1]):
                raise ProbeError(
                    f"head_init has shape {head.shape} but the head needs [{K}, "
                    f"{X.shape[1]}] (one row per class of classes_, the backbone's width)"
                )
            init = scaler.from_raw(head, np.zeros(K))
        with cpu_threads(self.device_):
            W, b, ok = train_sgd_head(
                scaler.transform(X),
                yi,
                K,
                lr=self.lr,
                steps=self.steps,
                batch_size=self.batch_size,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                milestones=list(self.milestones),
                seed=self.random_state,
                device=self.device_,
                init=init,
                drop_remainder=self.drop_remainder,
                nesterov=self.nesterov,
                on_epoch=None if self.epoch_callback is None else self._raw_callback(scaler),
            )
        self.coef_, self.intercept_ = scaler.to_raw(W, b)
        self._softmax_coef, self._softmax_intercept = self.coef_, self.intercept_
        self.finite_ = ok
        return self

    def _raw_callback(self, scaler):
        """``epoch_callback`` fed the head in raw space, softmax layout [K, D]."""

        callback = self.epoch_callback
        assert callback is not None  # wrapped only when set

        def cb(W: np.ndarray, b: np.ndarray) -> None:
            coef, intercept = scaler.to_raw(W, b)
            callback(coef, intercept)

        return cb


def _with_classes(seen: np.ndarray, yi: np.ndarray, classes) -> tuple[np.ndarray, np.ndarray]:
    """Class list and per-row class index when the caller fixes the classes."""
    if classes is None:
        return seen, yi
    classes = np.unique(np.asarray(classes))
    idx = np.searchsorted(classes, seen)
    if (idx >= classes.size).any() or not np.array_equal(classes[np.minimum(idx, classes.size - 1)], seen):
        missing = np.setdiff1d(seen, classes)[:10].tolist()
        raise ProbeError(
            f"labels {missing} are not in the given classes; pass every class that occurs in y (or classes=None)"
        )
    return classes, idx[yi]
