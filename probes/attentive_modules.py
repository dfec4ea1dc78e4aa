"""The attentive probes' torch modules, as their reference toolkits define them.

* ``vjepa``: V-JEPA's ``AttentiveClassifier`` (facebookresearch/jepa at 51c59d5,
  ``src/models/attentive_pooler.py`` with ``CrossAttentionBlock`` / ``CrossAttention`` / ``MLP``
  of ``src/models/utils/modules.py``): one learned query token, a pre-norm cross-attention
  block (LayerNorm on the tokens, q from the query, k/v from the tokens with bias, SDPA; its
  ``xattn.proj`` is built, initialised and rescaled but **not applied**, as the code's forward
  does, so the output projection is absent and ``proj`` never gets a gradient; it is kept so
  the parameter names and the initial random draws equal the reference's), the residual MLP
  (ratio 4, GELU), then ``linear`` to the classes. Init: every Linear of the pooler
  ``trunc_normal(std 0.02)`` with zero bias, LayerNorms 1/0, the query ``trunc_normal(0.02)``,
  ``xattn.proj`` and ``mlp.fc2`` divided by ``sqrt(2)`` (``_rescale_blocks``, layer 1); the
  classifier's ``linear`` keeps torch's default init (the reference does not re-initialise it).
* ``aim``: AIM's ``AttentionPoolingClassifier`` (apple/ml-aim at bd9e068,
  ``aim-v1/aim/v1/torch/layers.py``): ``BatchNorm1d(affine=False, eps 1e-6)`` over the tokens'
  channels, a learned ``cls_token`` (``randn * 0.02``) as the query used as is (no q
  projection), ``k`` / ``v`` without bias, SDPA, mean over queries, ``linear`` without bias;
  no MLP. Linears keep torch's default init.

* ``ep``: the efficient probe of arXiv 2506.10178 as billpsomas/efficient-probing at b8f4fb8
  builds it: ``poolings/ep.py:7-47`` ``EfficientProbing`` (``num_queries`` learned queries,
  ``randn * 0.02``, used as is: no q or k projection, keys are the tokens themselves, scale
  ``dim ** -0.5``; one value projection ``v`` without bias whose output is cut into
  ``num_queries`` slices, query ``i`` reading slice ``i`` only; the slices concatenated), then
  ``probe_heads.py:106`` ``Sequential(pooling, BatchNorm1d(dim, affine=False, eps=1e-6),
  Linear(dim, classes))`` (``probe_heads.py:75-76``, ``:104-105``: the pooling built first, then a
  fresh classifier; both keep torch's default init, ``main_linprobe.py`` re-initialises nothing).
  Its parameter names are the reference head's (``0.v.weight``, ``0.cls_token``, ``2.weight``,
  ``2.bias``).

All are built in the reference's order of construction, so a seeded build draws the same
random numbers as the reference's (tests/probes/test_probe_attentive.py and
tests/probes/test_attentive_ep.py check it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from featcache.core.registry import Registry
from featcache.errors import ProbeError

__all__ = [
    "ATTENTIVE_VARIANTS",
    "attention_heads",
    "build_attentive_head",
    "ep_parameter_count",
    "vjepa_parameter_count",
]

#: the attentive probe variants: name -> the function building its head class (torch imported
#: when called); each entry's ``note`` is the reference module it reproduces (recorded in hparams)
ATTENTIVE_VARIANTS: Registry[Callable[[], Any]] = Registry("attentive variant", ProbeError)


def attention_heads(dim: int, most: int = 16) -> int:
    """The pooler's attention heads for token width ``dim``: the largest divisor of ``dim`` up
    to ``most`` (16, V-JEPA 2's image-probe default; V-JEPA 1 takes the encoder's own count,
    which a store of tokens does not know)."""
    return max(h for h in range(1, min(most, dim) + 1) if dim % h == 0)


def trunc_normal_(tensor: Any, std: float, a: float = -2.0, b: float = 2.0) -> Any:
    """Fill ``tensor`` in place from N(0, std) truncated to [a, b] (absolute bounds) by the
    inverse-CDF method the reference uses (jepa ``src/utils/tensors.py``, as torch's
    ``trunc_normal_`` did before it switched to rejection sampling): one ``uniform_`` draw per
    value, so the random stream advances exactly as the reference's."""
    import torch

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        tensor.uniform_(2 * cdf(a / std) - 1, 2 * cdf(b / std) - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        return tensor.clamp_(min=a, max=b)


@ATTENTIVE_VARIANTS.register(
    "vjepa", note="facebookresearch/jepa src/models/attentive_pooler.py AttentiveClassifier (depth 1)"
)
@functools.cache
def _vjepa_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, in_features: int, hidden_features: int):
            super().__init__()
            self.fc1 = nn.Linear(in_features, hidden_features)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(hidden_features, in_features)
            self.drop = nn.Dropout(0.0)

        def forward(self, x):
            return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))

    class CrossAttention(nn.Module):
        def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
            super().__init__()
            self.num_heads = num_heads
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
            self.proj = nn.Linear(dim, dim)  # built (and rescaled) but not applied, as the reference's forward

        def forward(self, q, x):
            B, n, C = q.shape
            h = self.num_heads
            q = self.q(q).reshape(B, n, h, C // h).permute(0, 2, 1, 3)
            N = x.shape[1]
            kv = self.kv(x).reshape(B, N, 2, h, C // h).permute(2, 0, 3, 1, 4)
            q = F.scaled_dot_product_attention(q, kv[0], kv[1])
            return q.transpose(1, 2).reshape(B, n, C)

    class CrossAttentionBlock(nn.Module):
        def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.xattn = CrossAttention(dim, num_heads, qkv_bias)
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = MLP(dim, int(dim * mlp_ratio))

        def forward(self, q, x):
            q = q + self.xattn(q, self.norm1(x))
            return q + self.mlp(self.norm2(q))

    class AttentivePooler(nn.Module):
        def __init__(self, dim: int, num_heads: int, mlp_ratio: float, init_std: float, qkv_bias: bool):
            super().__init__()
            self.query_tokens = nn.Parameter(torch.zeros(1, 1, dim))
            self.cross_attention_block = CrossAttentionBlock(dim, num_heads, mlp_ratio, qkv_bias)
            self.init_std = init_std
            trunc_normal_(self.query_tokens, std=init_std)
            self.apply(self._init_weights)
            with torch.no_grad():  # _rescale_blocks: layer 1 of a complete block
                self.cross_attention_block.xattn.proj.weight.div_(math.sqrt(2.0))
                self.cross_attention_block.mlp.fc2.weight.div_(math.sqrt(2.0))

        def _init_weights(self, m):
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=self.init_std)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.LayerNorm):
                nn.init.constant_(m.bias, 0)
                nn.init.constant_(m.weight, 1.0)

        def forward(self, x):
            return self.cross_attention_block(self.query_tokens.repeat(len(x), 1, 1), x)

    class AttentiveClassifier(nn.Module):
        """V-JEPA's attentive classifier (depth 1, one query)."""

        def __init__(self, embed_dim: int, num_classes: int, num_heads: int, mlp_ratio: float = 4.0):
            super().__init__()
            self.pooler = AttentivePooler(embed_dim, num_heads, mlp_ratio, 0.02, True)
            self.linear = nn.Linear(embed_dim, num_classes, bias=True)

        def forward(self, x):
            return self.linear(self.pooler(x).squeeze(1))

    return AttentiveClassifier


@ATTENTIVE_VARIANTS.register("aim", note="apple/ml-aim aim-v1/aim/v1/torch/layers.py AttentionPoolingClassifier")
@functools.cache
def _aim_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class AttentionPoolingClassifier(nn.Module):
        """AIM's attention-pooling classifier (one query, batch norm, no MLP)."""

        def __init__(self, dim: int, out_features: int, num_heads: int):
            super().__init__()
            self.num_heads = num_heads
            self.k = nn.Linear(dim, dim, bias=False)
            self.v = nn.Linear(dim, dim, bias=False)
            self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.linear = nn.Linear(dim, out_features, bias=False)
            self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6)

        def forward(self, x):
            B, N, C = x.shape
            h = self.num_heads
            x = self.bn(x.transpose(-2, -1)).transpose(-2, -1)
            q = self.cls_token.expand(B, -1, -1).reshape(B, 1, h, C // h).permute(0, 2, 1, 3)
            k = self.k(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3)
            v = self.v(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3)
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, C)
            return self.linear(out.mean(dim=1))

    return AttentionPoolingClassifier


@ATTENTIVE_VARIANTS.register(
    "ep",
    note="billpsomas/efficient-probing@b8f4fb8 poolings/ep.py EfficientProbing + probe_heads.py BatchNorm1d + Linear",
)
@functools.cache
def _ep_class() -> Any:
    import torch
    from torch import nn

    class EfficientProbing(nn.Module):
        """poolings/ep.py:7-47 at b8f4fb8 (``d_out`` and ``num_heads`` kept; the leaderboard: 1, 1)."""

        def __init__(self, dim: int, num_heads: int = 1, num_queries: int = 32, d_out: int = 1):
            super().__init__()
            self.num_heads, self.d_out, self.num_queries = num_heads, d_out, num_queries
            self.scale = (dim // num_heads) ** -0.5
            self.v = nn.Linear(dim, dim // d_out, bias=False)
            self.cls_token = nn.Parameter(torch.randn(1, num_queries, dim) * 0.02)

        def forward(self, x):
            B, N, C = x.shape
            h, Q = self.num_heads, self.num_queries
            q = self.cls_token.expand(B, -1, -1).reshape(B, Q, h, C // h).permute(0, 2, 1, 3) * self.scale
            k = x.reshape(B, N, h, C // h).permute(0, 2, 1, 3)
            v = self.v(x).reshape(B, N, Q, C // (self.d_out * Q)).permute(0, 2, 1, 3)
            attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)  # [B, h, Q, N]
            return torch.matmul(attn.squeeze(1).unsqueeze(2), v).view(B, C // self.d_out)

    class EfficientProbingClassifier(nn.Sequential):
        """EP's probe head: the pooling, a non-affine BatchNorm, the linear classifier."""

        def __init__(self, dim: int, out_features: int, num_heads: int = 1, num_queries: int = 32, d_out: int = 1):
            if num_heads != 1 or dim % (d_out * num_queries):
                raise ProbeError(
                    f"attentive:ep needs token width {dim} divisible by its {num_queries} queries (x d_out {d_out}) "
                    f"and one head (got {num_heads}); pick --ep-queries dividing {dim // d_out}"
                )
            pooling = EfficientProbing(dim, num_heads, num_queries, d_out)  # first: fixes the random draws
            classifier = nn.Linear(dim // d_out, out_features, bias=True)
            super().__init__(pooling, nn.BatchNorm1d(dim // d_out, affine=False, eps=1e-6), classifier)

    return EfficientProbingClassifier


def ep_parameter_count(dim: int, n_classes: int, num_queries: int = 32) -> int:
    """Trainable parameters of the ``ep`` head (d_out 1): ``v`` (dim x dim), the queries
    (num_queries x dim) and the classifier (dim x classes + classes)."""
    return dim * dim + num_queries * dim + dim * n_classes + n_classes


def vjepa_parameter_count(dim: int, n_classes: int, mlp_ratio: float = 4.0) -> int:
    """Parameters of the ``vjepa`` head: the query, q (dim x dim + dim), kv (2 x), the unused
    proj (dim x dim + dim), two LayerNorms, the MLP and the classifier."""
    hidden = int(dim * mlp_ratio)
    attn = (dim * dim + dim) + (2 * dim * dim + 2 * dim) + (dim * dim + dim)
    return dim + attn + 4 * dim + (dim * hidden + hidden + hidden * dim + dim) + dim * n_classes + n_classes


def build_attentive_head(variant: str, dim: int, n_classes: int, num_heads: int, **options: Any) -> Any:
    """A fresh ``variant`` head (``torch.nn.Module``) for tokens of width ``dim``, initialised
    from torch's current random stream as the reference initialises it (``options``: the
    variant's own, e.g. ``ep``'s ``num_queries``)."""
    cls = ATTENTIVE_VARIANTS.resolve(variant)()
    return cls(dim, n_classes, num_heads, **options)
