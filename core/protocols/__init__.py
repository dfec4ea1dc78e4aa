"""Evaluation protocols as one registry: split plan, default seeds, hyper-parameter grid,
solver and pairing, for the probes (frozen features) and fine-tuning (images) alike.

Protocols are registered in the style of timm's ``register_model``: a factory decorated with
:func:`register_protocol` builds a frozen :class:`Protocol` from the spec's argument
(``fewshot:5`` calls the ``fewshot`` factory with ``"5"``); :func:`get_protocol` parses a
spec and :func:`list_protocols` names what is registered. Probe and fine-tune protocols live
in separate namespaces (``stage``), so ``full`` exists for both.

=============  ======  =====================================================================
spec           stage   meaning
=============  ======  =====================================================================
full           probe   DINOv2/Kornblith-style L-BFGS logistic regression on **standardised**
                       features (z-score with training statistics): C selected on
                       validation (the dataset's ``val`` split if it has one, else a
                       stratified, seeded 10% of train), refit on train+val, test once.
dinov2         probe   DINOv2's ``log_regression.py`` exactly: raw features, tol 1e-12,
                       max_iter 1000, its C grid, a plain random 10% (torch ``randperm``
                       seeded like ``torch.manual_seed(seed)``) unless the dataset has val.
fewshot:N      probe   ELEVATER's few-shot splits with the DINOv2-style L-BFGS C sweep (not
                       ELEVATER's search: see ``elevater-fewshot``): N examples per class
                       drawn from train (N counts *before* the 80/20 split), each class
                       split 80/20 (val = max(1, round(0.2 N)) per class) for selecting C,
                       refit on all N per class. N >= 2.
elevater-      probe   ELEVATER as published: the ``fewshot:N`` splits (or ``full``'s) with
fewshot:N,             its SGD search (:class:`ElevaterGrid`: 6 lrs x coarse-to-fine weight
elevater-full          decay, 10 epochs per trial, 50-epoch final run on train+val) on
                       L2-normalised features x logit scale 1/0.07; with
                       ``head_init`` the head starts from the L2-normalised class text
                       embeddings (ELEVATER's language init), else from zeros.
zeroshot       probe   the text head alone, no training (ELEVATER/CLIP zero-shot): logits =
                       normalised features . normalised class text embeddings
                       (``head_init``, default ``text``, stored per backbone x dataset).
vtab1k         probe   VTAB-1k as published: the first 800 of train and the first 200 of
                       the val source in the dataset's own order (the store's row order),
                       the same examples for every seed; select on the 200, retrain on the
                       1000. ``val_source``: ``split-800-200`` (default; val =
                       train[800:1000]) or ``official-val`` (val = val[:200]). Seeds 0, 1, 2
                       differ only in training randomness; each seed plus the median.
vtab1k-        probe   the earlier featcache rule: 1000 train examples drawn stratified per
stratified             seed, 800 / 200 stratified; ``official-val`` fits on the 1000 and
                       selects on the whole val split.
vtab1k-sgd     probe   VTAB-1k splits with the lightweight SGD schedule (batch 512, momentum
                       0.9, lr {0.1, 0.01} x {2500, 10000} steps, lr /10 at 1/3, 2/3 and
                       ``last_decay`` of the steps; no weight decay; every batch full, as
                       VTAB's ``drop_remainder`` and fine-tuning). VTAB Figure 16's linear
                       baseline: rows pair with fine-tune ``vtab1k-light``.
salman         probe   Salman et al.: SGD head, 150 epochs, batch 64, momentum 0.9, weight
                       decay 5e-4, lr {0.01, 0.001} selected on validation (as ``full``),
                       lr /10 every 50 epochs, refit on train+val.
bob-linear     probe   Battle of the Backbones' linear probe (bob-classification
                       ``linear_probe.py``, after MAE): BatchNorm (affine=False) + linear
                       head, LARS, 90 epochs, lr 0.1 x batch / 256 (batch 512), 10 warmup
                       epochs then cosine, no weight decay, on all of train; nothing is
                       selected; the last epoch is reported (BoB reports its best test epoch).
dinov2-linear  probe   DINOv2's ``eval/linear.py``: 52 linear heads (n_last_blocks {1, 4} x avgpool
                       {no, yes} x 13 lrs) trained jointly on the class tokens of the last
                       blocks (+ the mean patch token), SGD momentum 0.9, no weight decay,
                       cosine over 10 x 1250 iterations of batch 128, lr x batch / 256, heads
                       N(0, 0.01); the best head on val (the dataset's, else a seeded 10%
                       holdout) is reported on test without a refit (as the reference).
attentive:V    probe   attentive probes on ``tokens`` (V = ``vjepa``: V-JEPA's
                       AttentiveClassifier; ``aim``: AIM's AttentionPoolingClassifier): a
                       4 lr x 5 wd grid of heads trained together with V-JEPA's AdamW recipe
                       (cosine lr and wd, grad clip 1.0, 20 epochs), the best head chosen on
                       validation (as ``full``), reported on test without a refit.
attentive:ep   probe   the efficient probe (arXiv 2506.10178): 32 learned queries without q/k
                       projections, one value projection sliced per query, BatchNorm + linear;
                       one head, LARS lr 0.1 x batch / 256, 90 epochs (10 warmup, cosine), on
                       ``cls`` + ``tokens`` where stored; its best epoch on validation.
subset:F%      probe   Battle of the Backbones: stratified F% of train (label distribution
                       kept, at least one example per class), then ``full`` on that subset.
vtab1k-light   fine-   VTAB lightweight fine-tuning on the ``vtab1k`` splits; SGD grid as
               tune    ``vtab1k-sgd``; rows pair with probe ``vtab1k-sgd`` (Figure 16).
full           fine-   all of train, the ``full`` probe splits; rows pair with probe ``full``.
               tune
=============  ======  =====================================================================

A plan (:meth:`Protocol.plan`) works on labels only, in the canonical order of
:mod:`featcache.core.splits`, and returns positions into ``train ++ val`` (val rows follow the
train rows), so a probe row and a fine-tune row of paired protocols train, select and refit
on exactly the same examples for every seed.

The package: :mod:`~featcache.core.protocols.base` (:class:`Protocol`, :class:`SplitPlan` and
the two registries, :data:`PROTOCOLS` and :data:`SPLIT_PLANS`), :mod:`~.grids` (the
hyper-parameter grids), :mod:`~.plans` (the built-in split plans) and :mod:`~.builtin` (the
built-in protocols). A new protocol or split plan is one module of its own that calls
:func:`register_protocol` (or :func:`register_fixed_protocol`) / :func:`register_split_plan`;
every rule that differs between protocols is a field of :class:`Protocol`, its grid or its
split plan's :class:`SplitRules`, never a check of a name elsewhere.
"""

from __future__ import annotations

from featcache.core.protocols import (  # plans, builtin, dense: register the built-in members
    builtin,
    dense,
    grids,
    plans,
)
from featcache.core.protocols.base import (
    LAYER_SELECTIONS,
    PROTOCOLS,
    SPLIT_PLANS,
    STAGES,
    Protocol,
    SplitPlan,
    SplitRules,
    get_protocol,
    list_protocols,
    list_split_plans,
    pairs,
    parse_protocol,
    protocol_help,
    protocol_usages,
    register_fixed_protocol,
    register_protocol,
    register_split_plan,
    split_rules,
)
from featcache.core.protocols.grids import (
    BOB_LARS,
    C_GRID,
    DINOV2_C_GRID,
    DINOV2_LINEAR,
    ELEVATER_SGD,
    SALMAN_SGD,
    VTAB_LAST_DECAY,
    VTAB_SGD,
    AttentiveGrid,
    CGrid,
    Dinov2LinearGrid,
    ElevaterGrid,
    EpGrid,
    Grid,
    LarsGrid,
    SGDGrid,
    log_grid,
)
from featcache.core.protocols.plans import ELEVATER_MULTILABEL_VAL
from featcache.core.splits import VAL_SOURCES
from featcache.errors import ProtocolError

__all__ = [
    "BOB_LARS",
    "C_GRID",
    "DINOV2_C_GRID",
    "DINOV2_LINEAR",
    "ELEVATER_MULTILABEL_VAL",
    "ELEVATER_SGD",
    "LAYER_SELECTIONS",
    "PROTOCOLS",
    "SALMAN_SGD",
    "SPLIT_PLANS",
    "STAGES",
    "VAL_SOURCES",
    "VTAB_LAST_DECAY",
    "VTAB_SGD",
    "AttentiveGrid",
    "CGrid",
    "Dinov2LinearGrid",
    "ElevaterGrid",
    "EpGrid",
    "Grid",
    "LarsGrid",
    "Protocol",
    "ProtocolError",
    "SGDGrid",
    "SplitPlan",
    "SplitRules",
    "builtin",
    "dense",
    "get_protocol",
    "grids",
    "list_protocols",
    "list_split_plans",
    "log_grid",
    "pairs",
    "parse_protocol",
    "plans",
    "protocol_help",
    "protocol_usages",
    "register_fixed_protocol",
    "register_protocol",
    "register_split_plan",
    "split_rules",
]
