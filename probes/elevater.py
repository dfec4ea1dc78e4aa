"""ELEVATER's linear-probe search on cached features (``elevater-fewshot:N``, ``elevater-full``),
as the toolkit's code runs it (Computer-Vision-in-the-Wild/Elevater_Toolkit_IC,
vision_benchmark/evaluation/full_model_finetune.py; tests/elevater_toolkit_ref.py ports it).

For each of the grid's learning rates a coarse-to-fine weight-decay search
(:func:`search_weight_decay`, from the toolkit's initial best score 0), each trial a head
trained by :func:`train_elevater_head` for ``search_epochs`` on the plan's train rows and
scored on its best validation epoch; the best (lr, wd) (from the toolkit's initial best: score
0, lr 0, wd 0) is retrained for ``final_epochs`` on train+val. The head is the toolkit's
``Classifier`` on features: ``BatchNorm1d(affine=False)`` (``ElevaterGrid.features="bn"``:
batch statistics while training, running statistics at evaluation) or L2 normalisation
(``"l2"``: ``NORMALIZE_VISUAL_FEATURE``), then ``nn.Linear`` (its default initialisation, or
with ``head_init`` the L2-normalised class text embeddings and a zero bias: ELEVATER's
language-initialised head), the logits times the fixed logit scale. Batches follow the
toolkit's ``DataLoader`` (generator seeded 0; a base seed drawn before each epoch's
permutation); a batch of one row is skipped, as ``train_one`` does.

Randomness is the toolkit's one stream: ``commands/linear_probe.py:62-66`` seeds torch once
(``--fix_seed``, here the fit's seed) and never again, so every trial's ``Classifier``
(``full_model_finetune.py:232``, its ``nn.Linear`` at ``:104``) draws its initial weights
from the running stream, which every validation pass advances too (its unshuffled
``DataLoader`` has ``generator=None``, so torch's ``_BaseDataLoaderIter.__init__`` draws one
int64 base seed from the stream per pass). A fit here holds that stream as one private
``torch.Generator``, seeded once per fit (the process's global generator is not touched), and
replays the draws in the toolkit's order: the head, then one draw after each epoch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.errors import MetricInputError, ProbeError
from featcache.probes.solver_registry import FitOutcome, FitRequest, ProbeConfigError, register_solver

__all__ = [
    "ElevaterHead",
    "draw_loader_seed",
    "fit_elevater",
    "fit_elevater_multilabel",
    "l2_normalise",
    "linear_from_stream",
    "random_stream",
    "search_weight_decay",
    "train_elevater_head",
    "zeroshot_logits",
]

#: the toolkit's ``create_dataloader`` seeds every loader's generator with 0
LOADER_SEED = 0
#: recorded in the hparams (and the run id) of every ELEVATER fit since the loop is the toolkit's;
#: "-stream": since its random stream is the toolkit's too (seeded once per fit, issue 49)
HEAD_LOOP = "toolkit-stream"


def l2_normalise(X: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows stay zero)."""
    X = np.asarray(X, np.float64)
    n = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.where(n > 0, n, 1.0)


def zeroshot_logits(X: np.ndarray, text: np.ndarray) -> np.ndarray:
    """CLIP-style zero-shot logits: normalised features [n, D] . normalised text [K, D]^T."""
    return l2_normalise(X) @ l2_normalise(text).T


def search_weight_decay(
    score: Callable[[int], float], n_wds: int, coarse: Sequence[int], spans: Sequence[int], start: float = -math.inf
) -> tuple[int, float, int]:
    """ELEVATER's coarse-to-fine search over weight-decay indices ``0..n_wds-1``
    (``hyperparameter_sweep``, full_model_finetune.py:160-215): score the ``coarse`` indices,
    then for each span the neighbours ``peak -/+ span`` (clipped to the ends) of the best so
    far that differ from the peak; a candidate wins only when strictly better than the best so
    far, which starts at ``start`` with peak ``-1`` (the toolkit: 0; a search where nothing
    beats it keeps peak -1, the neighbours of -1 are 0 and ``span - 1``, and the toolkit then
    reads ``l2_lambda_list[-1]``, the last value). Every candidate is a new trial, as in the
    toolkit (:185-204): an index already scored, or both clipped neighbours at the same index,
    is trained again (from the next draws of the fit's random stream), never read from a
    cache. Returns (best index, its score, number of trials)."""
    n = 0

    def s(i: int) -> float:
        nonlocal n
        n += 1
        return score(i)

    peak, best = -1, start
    for i in coarse:
        if (v := s(i)) > best:
            peak, best = i, v
    for span in spans:
        left, right = max(peak - span, 0), min(peak + span, n_wds - 1)
        for j in [k for k in (left, right) if k != peak]:
            if (v := s(j)) > best:
                peak, best = j, v
    return peak, best, n


def random_stream(seed: int) -> Any:
    """The fit's random stream: a CPU ``torch.Generator`` in the state ``torch.manual_seed(seed)``
    leaves the global one in (the toolkit's ``--fix_seed``, commands/linear_probe.py:62-66)."""
    import torch

    return torch.Generator().manual_seed(int(seed))


def linear_from_stream(dim: int, n_out: int, rng: Any) -> Any:
    """``torch.nn.Linear(dim, n_out)`` with its default initialisation drawn from ``rng`` (a
    ``torch.Generator``, advanced by exactly the draws the constructor makes from the global
    generator; an int: a fresh stream seeded with it). The global generator is left as it was."""
    import torch

    gen = rng if isinstance(rng, torch.Generator) else random_stream(int(rng))
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(gen.get_state())
        lin = torch.nn.Linear(dim, n_out)  # reset_parameters: kaiming_uniform_ W, uniform_ b
        gen.set_state(torch.get_rng_state())
    return lin


def draw_loader_seed(rng: Any) -> int:
    """One validation pass's draw: iterating a ``DataLoader`` built with ``generator=None``
    draws its base seed, one int64, from the global stream (torch/utils/data/dataloader.py,
    ``_BaseDataLoaderIter.__init__``: ``torch.empty((), dtype=torch.int64).random_(generator=
    loader.generator)``); the toolkit's unshuffled validation and test loaders are such
    (feature.py:96, ``generator=generator if shuffle else None``)."""
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=rng).item())


class ElevaterHead:
    """The toolkit's ``Classifier`` head on features, as a torch module's state: normalisation
    (``"bn"``: channel BatchNorm without affine, running statistics with momentum 0.1;
    ``"l2"``: ``F.normalize``), linear layer (default initialisation drawn from ``rng``: the
    fit's ``torch.Generator``, or an int seeding a fresh one), logits times ``exp(log_scale)``."""

    def __init__(
        self,
        dim: int,
        n_out: int,
        features: str,
        logit_scale: float,
        rng: Any,
        init: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        import torch

        if features not in ("bn", "l2"):
            raise ProbeError(f"ElevaterGrid.features must be 'bn' or 'l2', got {features!r}")
        self.features = features
        self.bn = torch.nn.BatchNorm1d(dim, affine=False) if features == "bn" else torch.nn.Identity()
        self.lin = linear_from_stream(dim, n_out, rng)
        if init is not None:
            with torch.no_grad():
                self.lin.weight.copy_(torch.as_tensor(np.asarray(init[0]), dtype=torch.float32))
                self.lin.bias.copy_(torch.as_tensor(np.asarray(init[1]), dtype=torch.float32))
        # the toolkit's logit_scale: a fixed parameter holding the log, exponentiated in forward
        self.log_scale = torch.ones([]) * math.log(logit_scale)

    def to(self, device: str) -> ElevaterHead:
        self.bn, self.lin, self.log_scale = self.bn.to(device), self.lin.to(device), self.log_scale.to(device)
        return self

    def train(self, mode: bool = True) -> None:
        self.bn.train(mode)
        self.lin.train(mode)

    def forward(self, X_t: Any) -> Any:
        """The toolkit's ``Classifier.forward`` after the backbone: a torch tensor of logits."""
        import torch.nn.functional as F

        out = self.bn(X_t)
        if self.features == "l2":
            out = F.normalize(out)
        return self.log_scale.exp() * self.lin(out)

    def snapshot(self) -> ElevaterHead:
        """A CPU copy of the head as it is now (for a later epoch's report)."""
        h = copy.copy(self)
        h.bn, h.lin = copy.deepcopy(self.bn).cpu(), copy.deepcopy(self.lin).cpu()
        h.log_scale = self.log_scale.detach().cpu()
        return h

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """``validate``'s ``outputs.softmax(-1)`` in evaluation mode (running statistics)."""
        import torch

        dev = self.lin.weight.device
        self.train(False)
        with torch.no_grad():
            z = self.forward(torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(dev))
            return z.softmax(-1).double().cpu().numpy()

    @property
    def finite(self) -> bool:
        import torch

        return bool(torch.isfinite(self.lin.weight).all() and torch.isfinite(self.lin.bias).all())


def train_elevater_head(
    X: np.ndarray,
    y: np.ndarray,
    n_out: int,
    *,
    lr: float,
    weight_decay: float,
    epochs: int,
    grid: Any,
    seed: int = 0,
    device: str = "cpu",
    loss: str = "ce",
    init: tuple[np.ndarray, np.ndarray] | None = None,
    on_epoch: Callable[[ElevaterHead], object] | None = None,
    rng: Any = None,
) -> ElevaterHead:
    """The toolkit's ``train_task`` loop on features (full_model_finetune.py:229-288): the
    ``Classifier`` (its ``nn.Linear`` drawn from ``rng``, the fit's random stream; ``None``: a
    fresh stream seeded with ``seed``), then per epoch ``train_one`` (training mode, SGD with
    ``grid.momentum``/``grid.nesterov`` and weight decay on W and b, constant ``lr``;
    cross-entropy on class indices or, ``loss="bce"``, ``BCEWithLogitsLoss`` on an [n, C] 0/1
    matrix) and the validation pass: one draw from ``rng`` (:func:`draw_loader_seed`, made
    whether or not the caller scores), then ``on_epoch(head)`` (the caller scores it; the head
    is in evaluation mode). Batches of ``grid.batch_size`` come from the toolkit's
    ``DataLoader`` (shuffled, its own generator seeded :data:`LOADER_SEED`, no dropped
    remainder) over the row indices; a batch of one row is skipped. ``init``:
    ``(W [K, D], b [K])`` written over the drawn initialisation (the toolkit draws it first
    too). A diverged head keeps training, as in the toolkit (its :attr:`ElevaterHead.finite`
    says so)."""
    import torch

    if loss not in ("ce", "bce"):
        raise ProbeError(f"loss must be 'ce' or 'bce', got {loss!r}")
    bce = loss == "bce"
    criterion = torch.nn.BCEWithLogitsLoss() if bce else torch.nn.CrossEntropyLoss()
    X_t = torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(device)
    y_t = torch.from_numpy(np.asarray(y, np.float32 if bce else np.int64)).to(device)
    n = X_t.shape[0]
    rng = random_stream(seed) if rng is None else rng
    head = ElevaterHead(X_t.shape[1], n_out, grid.features, grid.logit_scale, rng, init).to(device)
    opt = torch.optim.SGD(
        head.lin.parameters(), lr=lr, momentum=grid.momentum, weight_decay=weight_decay, nesterov=grid.nesterov
    )
    # the toolkit's create_dataloader over the row indices: the installed torch's own draws
    # (each epoch's iterator draws a base seed, then RandomSampler permutes; torch >= 1.11's
    # sampler also draws a second, unused permutation when an epoch ends)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(n)),
        batch_size=grid.batch_size,
        shuffle=True,
        drop_last=False,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )
    for _ in range(epochs):
        head.train(True)
        for (bi,) in loader:
            if bi.numel() == 1:
                continue  # train_one: "if images.shape[0] == 1: continue"
            bi = bi.to(device)
            opt.zero_grad()
            criterion(head.forward(X_t[bi]), y_t[bi]).backward()
            opt.step()
        head.train(False)
        draw_loader_seed(rng)  # validate(): iterating the unshuffled loader (train_task, :270)
        if on_epoch is not None:
            on_epoch(head)
    return head


def _search(
    grid, val_score: Callable[[float, float], float], metric: str, trial_epochs: Sequence[int] | None = None
) -> tuple[tuple[float, float, float], int, list[dict[str, Any]], int]:
    """ELEVATER's (lr, wd) search (``hyperparameter_sweep_lr``, full_model_finetune.py:422-442):
    per lr of the grid the coarse-to-fine weight-decay search of ``val_score(lr, wd)`` (one
    call per trial, in the toolkit's order); an lr wins only when strictly better than the best
    so far, which starts at the toolkit's (score 0, lr 0, wd 0). ``trial_epochs``: each
    trial's best epoch, in call order (filled by ``val_score``). Returns ((score, lr, wd) of
    the best, its trial's best epoch, per-lr records with every trial's score, trials)."""
    if not grid.lrs:
        raise ProbeError("the ELEVATER grid has no learning rate")
    best: tuple[float, float, float] = (0.0, 0.0, 0.0)
    best_epoch, trials, per_lr = 0, 0, []
    for lr in grid.lrs:
        log: list[tuple[int, float]] = []  # (weight-decay index, score) of each trial, in order

        def score(k: int, lr=lr, log=log) -> float:
            log.append((k, val_score(lr, grid.wds[k])))
            return log[-1][1]

        i, sc, n = search_weight_decay(score, len(grid.wds), grid.coarse, grid.spans, start=0.0)
        wd = grid.wds[i]  # i = -1 (nothing beat 0): the toolkit's l2_lambda_list[-1]
        # the winning trial: the first at index i scoring sc (a later equal score cannot win)
        win = next((t for t, (k, v) in enumerate(log) if k == i and v == sc), None)
        epoch = trial_epochs[trials + win] if trial_epochs is not None and win is not None else 0
        trials += n
        per_lr.append(
            {
                "lr": lr,
                "weight_decay": wd,
                f"val_{metric}": sc,
                "best_epoch": epoch,
                "trials": n,
                "trial_scores": [[grid.wds[k], v] for k, v in log],
            }
        )
        if best[0] < sc:
            best, best_epoch = (sc, lr, wd), epoch
    return best, best_epoch, per_lr, trials


def _best_epoch(scores: list[float]) -> tuple[float, int]:
    """(best value, its 1-based epoch): the first strict maximum from 0 (0, 0 when none)."""
    best, at = 0.0, 0
    for e, v in enumerate(scores, 1):
        if v > best:
            best, at = v, e
    return best, at


def _hparams(req: FitRequest, device: str, best, best_epoch: int, per_lr, trials: int, head: str) -> dict:
    """The results-row record of one ELEVATER fit (single- or multi-label)."""
    grid, opts = req.proto.grid, req.opts
    sc, lr, wd = best
    metric = opts.get("metric") or "top1"
    se, fe = opts["search_epochs"], opts["final_epochs"]
    hp = {
        "solver": "elevater-sgd",
        "device": device,
        "lr": lr,
        "weight_decay": wd,
        f"val_{metric}": sc,
        "best_epoch": best_epoch,
        "selection": f"val {metric} at each trial's best search epoch (ties: earlier epoch, smaller lr, earlier probe)",
        "random_stream": "one torch generator seeded once per fit: every head's init and one draw per validation pass",
        "trials": trials,
        "per_lr": per_lr,
        "search_epochs": se,
        "final_epochs": fe,
        "batch_size": grid.batch_size,
        "momentum": grid.momentum,
        "nesterov": grid.nesterov,
        "features": grid.features,
        "logit_scale": grid.logit_scale,
        "head": head,
        "head_loop": HEAD_LOOP,
        "batch_order": f"torch DataLoader shuffle, generator seeded {LOADER_SEED}; size-1 batches skipped",
        "report": "best test epoch (selected on the test split, as the ELEVATER toolkit)"
        if opts.get("final_epoch") == "best-test"
        else "final epoch (not the best test epoch)",
    }
    if grid.features == "bn":
        hp["bn"] = "batch statistics in training, running statistics (momentum 0.1) at evaluation"
    if lr == 0:
        hp["selection_note"] = "no trial scored above 0 on validation: the toolkit's initial (lr 0, wd 0) is kept"
    scaled = {
        k: v
        for k, v, pub in (("search_epochs", se, grid.search_epochs), ("final_epochs", fe, grid.final_epochs))
        if v != pub
    }
    if scaled:
        hp["scaled"] = True
        hp["scaled_from"] = {k: getattr(grid, k) for k in scaled}
    return hp


def _epoch_score(metric: str, y: np.ndarray, X: np.ndarray, head: ElevaterHead) -> float:
    """The task metric of one epoch's head on (X, y) from its softmax probabilities, as the
    toolkit's ``validate`` scores ``outputs.softmax(-1)``; 0 where the metric cannot be
    computed (the toolkit's ``except: metric_result = 0.``)."""
    from featcache.core.metrics import METRICS

    try:
        return float(METRICS[metric](y, head.predict_proba(X)))
    except (MetricInputError, ValueError, FloatingPointError):
        return 0.0


def _fit(req: FitRequest, sets, n_out: int, loss: str, metric: str, init) -> tuple:
    """Search on ``sets`` = ((Xtr, ytr), (Xva, yva), (Xfin, yfin)), then the final run, all
    from one random stream seeded once with the fit's seed (never reseeded): returns (final
    head, epoch heads of the final run for best-test, best, its best epoch, per_lr, trials,
    device, seconds)."""
    from featcache.probes.logistic import cpu_threads, resolve_backend

    grid, opts = req.proto.grid, req.opts
    device = resolve_backend("torch")[1]
    (Xtr, ytr), (Xva, yva), (Xfin, yfin) = sets
    rng = random_stream(req.seed)  # linear_probe.py:62-66: torch.manual_seed(fix_seed), once
    trial_epochs: list[int] = []

    def train(X, y, lr, wd, epochs, on_epoch=None) -> ElevaterHead:
        with cpu_threads(device):
            return train_elevater_head(
                X, y, n_out, lr=lr, weight_decay=wd, epochs=epochs, grid=grid, device=device,
                loss=loss, init=init, on_epoch=on_epoch, rng=rng,
            )  # fmt: skip

    def val_score(lr, wd) -> float:
        """The trial's best epoch on the task metric (the toolkit's SEARCH_RESULT_ON_LAST_EPOCH
        =False: it validates after every epoch and keeps the first strict maximum, from 0)."""
        scores: list[float] = []
        train(Xtr, ytr, lr, wd, opts["search_epochs"], lambda h: scores.append(_epoch_score(metric, yva, Xva, h)))
        best, at = _best_epoch(scores)
        trial_epochs.append(at)
        return best

    t0 = time.perf_counter()
    best, best_epoch, per_lr, trials = _search(grid, val_score, metric, trial_epochs)
    _, lr, wd = best
    heads: list[ElevaterHead] = []
    keep = (lambda h: heads.append(h.snapshot())) if opts.get("final_epoch") == "best-test" else None
    final = train(Xfin, yfin, lr, wd, opts["final_epochs"], keep)
    return final, heads, best, best_epoch, per_lr, trials, device, time.perf_counter() - t0


def fit_elevater_multilabel(req: FitRequest) -> FitOutcome:
    """Multi-label targets (``plan.Y``, [n, C] 0/1) as the toolkit fits VOC 2007: the same
    (lr, wd) search and final run as :func:`fit_elevater`, but the head trained with
    BCE-with-logits and every epoch scored by the task metric (a ranking metric, e.g.
    ``map11_elevater``) of the softmax of its outputs. Source: Computer-Vision-in-the-Wild/
    Elevater_Toolkit_IC, vision_benchmark/evaluation/full_model_finetune.py: ``train_task``
    sets ``criterion = torch.nn.BCEWithLogitsLoss()`` for MULTILABEL_DATASETS
    (voc-2007-classification, chestx-ray8) and ``validate`` scores
    ``outputs.softmax(-1)`` (softmax, not sigmoid) with ``config.TEST.METRIC``; the predicted
    scores here are the same softmax."""
    plan, opts = req.plan, req.opts
    Ys = [np.asarray(Y, bool) for Y in plan.Y]
    sets = [(np.asarray(X, np.float64), Y) for (X, _), Y in zip((plan.tr, plan.va, plan.fin), Ys, strict=True)]
    metric = opts.get("metric") or "map11_elevater"
    C = Ys[0].shape[1]
    # head_init: one normalised text embedding per label column, bias 0 (as for single-label)
    init = None if req.head_init is None else (l2_normalise(np.asarray(req.head_init)), np.zeros(C))
    final, heads, best, best_epoch, per_lr, trials, device, seconds = _fit(req, sets, C, "bce", metric, init)
    head = "linear-default-seeded" if init is None else "text-initialised"
    hp = _hparams(req, device, best, best_epoch, per_lr, trials, head)
    hp.update(loss="bce", n_labels=int(C), scores="softmax over the label columns (the toolkit's validate)")
    epochs = tuple(h.predict_proba for h in heads)
    return FitOutcome(final.snapshot().predict_proba, None, hp, final.finite, seconds, epochs)


@dataclass(frozen=True)
class ElevaterOptions:
    """The ELEVATER search's epochs and reporting rule; ``None``: the protocol grid's (10, 50)."""

    search_epochs: int | None = flag(
        None, "elevater-*: epochs per search trial (paper: 10)", type=int, check=Interval(int, 1)
    )
    final_epochs: int | None = flag(
        None, "elevater-*: epochs of the final run on train+val (paper: 50)", type=int, check=Interval(int, 1)
    )
    final_epoch: str = flag(
        "last",
        "elevater-*: the epoch of the final run that is reported: 'last' (default, an honest "
        "held-out number) or 'best-test', the ELEVATER toolkit's rule, which SELECTS THE EPOCH "
        "ON THE TEST SPLIT (each eval split picks its own best epoch; optimistic)",
        choices=["last", "best-test"],
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.final_epoch not in ("last", "best-test"):
            raise ProbeConfigError(f"final_epoch must be 'last' or 'best-test' (got {self.final_epoch!r})")

    def resolve(self, proto: Any) -> ElevaterOptions:
        """The grid's epochs where not given."""
        from dataclasses import replace

        g = proto.grid
        return replace(
            self,
            search_epochs=self.search_epochs if self.search_epochs is not None else getattr(g, "search_epochs", None),
            final_epochs=self.final_epochs if self.final_epochs is not None else getattr(g, "final_epochs", None),
        )


@register_solver(
    "elevater",
    options=ElevaterOptions,
    fit_multilabel=fit_elevater_multilabel,
    multilabel_head_init=True,
    recorded={"head_loop": HEAD_LOOP},  # the toolkit's loop: BN modes, seeded nn.Linear init, its batches
)
def fit_elevater(req: FitRequest) -> FitOutcome:
    """Search (lr, wd) on ``plan.tr``/``plan.va``, refit on ``plan.fin``; ``head_init``: [C, D]
    class embeddings of the dataset's classes or ``None`` (``nn.Linear``'s default init, seeded)."""
    plan, opts, head_init = req.plan, req.opts, req.head_init
    ytr, yva, yfin = plan.tr[1], plan.va[1], plan.fin[1]
    classes = np.unique(ytr)
    if np.setdiff1d(np.concatenate([yva, yfin]), classes).size:
        raise ProbeError(
            "validation/final training data hold classes absent from the selection "
            "train data; resample the split so every class is in train"
        )
    K = classes.size
    init = None if head_init is None else (l2_normalise(np.asarray(head_init)[classes]), np.zeros(K))
    sets = [(np.asarray(X, np.float64), np.searchsorted(classes, y)) for X, y in (plan.tr, plan.va, plan.fin)]
    metric = opts.get("metric") or "top1"
    final, heads, best, best_epoch, per_lr, trials, device, seconds = _fit(req, sets, K, "ce", metric, init)
    head = "linear-default-seeded" if init is None else "text-initialised"
    hp = _hparams(req, device, best, best_epoch, per_lr, trials, head)
    epochs = tuple(h.predict_proba for h in heads)
    return FitOutcome(final.snapshot().predict_proba, classes, hp, final.finite, seconds, epochs)
