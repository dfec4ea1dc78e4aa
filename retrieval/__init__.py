"""Retrieval on cached features (Battle of the Backbones protocol, Goldblum et al. 2023; docs/protocols.md).

Semantic retrieval (a match shares the query's label) or content retrieval (explicit
positive/junk table); cosine, inner-product or L2 similarity; exact FAISS / torch search and
blockwise full ranking; mAP, MRR, recall@k, hit@k, precision@k and DINO-style k-NN
classification. Metric formulas and the tie policy: :mod:`featcache.retrieval.metrics`.

>>> from featcache.retrieval import run_retrieval
>>> from featcache.retrieval import RetrievalConfig
>>> cfg = RetrievalConfig(cache="cache.zarr", dataset="digits", backbones=("tf_efficientnet_lite0",),
...                       query_split="test", gallery_split="train", results_path="results.parquet")
>>> df = run_retrieval(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from featcache.core.stagerun import Stage, register_stage
from featcache.retrieval.config import RetrievalConfig
from featcache.retrieval.knn import KNN_KS, KNN_TEMPERATURE, knn_accuracy, knn_predict, knn_votes
from featcache.retrieval.metrics import (
    RankedRelevance,
    average_precision,
    compute_metrics,
    hit_at_k,
    precision_at_k,
    ranks_from_hits,
    ranks_from_scores,
    recall_at_k,
    reciprocal_rank,
    summarize,
)
from featcache.retrieval.prepared import PreparedRows
from featcache.retrieval.ranking import full_ranking, full_ranking_metrics
from featcache.retrieval.relevance import (
    ExplicitRelevance,
    Relevance,
    SemanticRelevance,
    load_relevance_table,
)
from featcache.retrieval.revisited import (
    REVISITED_SETUPS,
    revisited_ap,
    revisited_precision_at_k,
    revisited_table,
    table_from_revisitop_gnd,
)
from featcache.retrieval.run import DEFAULT_KS, TIE_POLICY, evaluate, run_retrieval
from featcache.retrieval.search import choose_backend, parse_memory, prepare, topk

__all__ = [
    "DEFAULT_KS",
    "KNN_KS",
    "KNN_TEMPERATURE",
    "REVISITED_SETUPS",
    "TIE_POLICY",
    "ExplicitRelevance",
    "PreparedRows",
    "RankedRelevance",
    "Relevance",
    "RetrievalConfig",
    "SemanticRelevance",
    "average_precision",
    "choose_backend",
    "compute_metrics",
    "evaluate",
    "full_ranking",
    "full_ranking_metrics",
    "hit_at_k",
    "knn_accuracy",
    "knn_predict",
    "knn_votes",
    "load_relevance_table",
    "parse_memory",
    "precision_at_k",
    "prepare",
    "ranks_from_hits",
    "ranks_from_scores",
    "recall_at_k",
    "reciprocal_rank",
    "revisited_ap",
    "revisited_precision_at_k",
    "revisited_table",
    "run_retrieval",
    "summarize",
    "table_from_revisitop_gnd",
    "topk",
]

#: this stage's entry in the stage registry (the sweep runs its work items through it)
register_stage(Stage("retrieval", "featcache.retrieval:run_retrieval"))
