"""The token feature kinds (issue 46), their spelling and arithmetic, shared by the timm head
(:class:`featcache.extract.features.FeatureHead`) and the sources that compute their own kinds
(``open_clip:``, ``hf:``):

- ``blocks:K``: the class token of each of the last K blocks through the model's final norm
  (DINOv2's ``get_intermediate_layers(n=K, return_class_token=True, norm=True)``), oldest block
  first; per row ``(K, D)``;
- ``tokens``: the last block's patch tokens through the final norm, prefix (class, register)
  tokens excluded; a CNN's final feature map positions, row-major over H then W; ``(T, D)``;
- ``tokens@GxG``: ``tokens`` area-pooled to a G x G grid (``adaptive_avg_pool2d``); ``(G*G, D)``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from featcache.errors import ConfigError

#: how the token kinds are spelled in --features, and how a source lists them in ``Backbone.kinds``
TOKEN_KINDS = ("blocks:K", "tokens", "tokens@GxG")
_BLOCKS_RE = re.compile(r"^blocks:(\d+)$")
_GRID_RE = re.compile(r"^tokens@(\d+)x(\d+)$")
_FLAG = "(--features / features=)"


def parse_token_kind(kind: str) -> tuple[str, int] | None:
    """``("blocks", K)``, ``("tokens", 0)`` or ``("grid", G)`` for a token kind, None for any
    other kind; a malformed token spelling (``blocks:0``, ``tokens@2x3``) is a one-line error."""
    if kind == "tokens":
        return ("tokens", 0)
    if kind.startswith("blocks"):
        m = _BLOCKS_RE.match(kind)
        if not m or int(m[1]) < 1:
            raise ConfigError(
                f"feature kind {kind!r} is malformed: spell blocks:K with K >= 1, the number of last blocks "
                f"whose class tokens are kept (e.g. blocks:4) {_FLAG}"
            )
        return ("blocks", int(m[1]))
    if kind.startswith("tokens@"):
        m = _GRID_RE.match(kind)
        if not m or m[1] != m[2] or int(m[1]) < 1:
            raise ConfigError(
                f"feature kind {kind!r} is malformed: spell tokens@GxG with G >= 1, the side of the square grid "
                f"the patch tokens are area-pooled to (e.g. tokens@2x2) {_FLAG}"
            )
        return ("grid", int(m[1]))
    return None


def kind_template(kind: str) -> str:
    """The spelling a source lists for ``kind``: ``blocks:4`` -> ``blocks:K``, ``tokens@2x2`` ->
    ``tokens@GxG``, any other kind itself."""
    p = parse_token_kind(kind)
    return kind if p is None else {"blocks": "blocks:K", "tokens": "tokens", "grid": "tokens@GxG"}[p[0]]


def check_blocks(k: int, n_blocks: int, name: str) -> None:
    """``blocks:K`` needs K <= the model's block count."""
    if k > n_blocks:
        raise ConfigError(
            f"feature kind blocks:{k}: {name} has {n_blocks} blocks; choose blocks:K with K in 1..{n_blocks} {_FLAG}"
        )


def no_class_token(name: str, why: str = "has no class token") -> ConfigError:
    """The one-line refusal of ``blocks:K`` for a backbone without class tokens."""
    return ConfigError(
        f"feature kind blocks:K: {name} {why}, so there are no per-block class tokens; use tokens, tokens@GxG "
        f"or pooled instead (dinov2-linear puts pooled in the class-token slot) {_FLAG}"
    )


def token_grid(n_tokens: int, hw: Any, name: str) -> tuple[int, int]:
    """The (H, W) patch grid of ``n_tokens`` patch tokens: ``hw`` where it fits, else a square."""
    if hw is not None and int(hw[0]) * int(hw[1]) == n_tokens:
        return int(hw[0]), int(hw[1])
    s = math.isqrt(n_tokens)
    if s * s != n_tokens:
        raise ConfigError(
            f"feature kind tokens@GxG: {name}'s {n_tokens} patch tokens form no known grid; use tokens {_FLAG}"
        )
    return s, s


def grid_pool(tokens: Any, hw: tuple[int, int], g: int, name: str) -> Any:
    """Patch tokens ``[B, H*W, D]`` (row-major over H then W) area-pooled to ``[B, G*G, D]``
    (``adaptive_avg_pool2d`` over the ``hw`` grid)."""
    b, _, d = tokens.shape
    return map_pool(tokens.transpose(1, 2).reshape(b, d, *hw), g, name, "patch grid")


def map_pool(fmap: Any, g: int, name: str, what: str = "final feature map") -> Any:
    """A feature map ``[B, C, H, W]`` area-pooled to G x G positions ``[B, G*G, C]``."""
    import torch.nn.functional as F

    h, w = fmap.shape[-2:]
    if g > min(h, w):
        raise ConfigError(
            f"feature kind tokens@{g}x{g}: {name}'s {what} is {h}x{w} at this input size; choose tokens@GxG "
            f"with G in 1..{min(h, w)}, or tokens for all {h * w} {_FLAG}"
        )
    return F.adaptive_avg_pool2d(fmap, g).flatten(2).transpose(1, 2)


def map_tokens(fmap: Any) -> Any:
    """A feature map ``[B, C, H, W]`` as its positions ``[B, H*W, C]`` (row-major over H then W)."""
    return fmap.flatten(2).transpose(1, 2)
