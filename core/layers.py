"""Per-layer feature kinds (issue 56): how ``--features layers:all|LIST`` names what it stores,
and how the probes, retrieval and similarity find a stored layer again.

One forward pass stores, for each chosen block (ViT) or stage (CNN), kinds named by the layer's
0-based index ``i`` (negative indices are resolved against the layer count first):

- ``layer{i}_cls``: the block's class token through the model's final norm;
- ``layer{i}_mean``: the block's mean patch token through the final norm;
- ``layer{i}_cls_raw`` / ``layer{i}_mean_raw``: the same before the final norm;
- ``layer{i}_avg``: a CNN stage's global average (no norm);
- ``layer{i}_tokens``: the block's patch tokens through the final norm, ``[T, D]`` row-major
  over the token grid (issue 57's dense heads; ``--features layers:tokens:LIST`` stores them with
  the block's ``layer{i}_cls``). Not a part of :data:`LAYER_PARTS`: sweeps never pick it.

A layer list is ``all``, comma-separated indices (negative from the end), or a recipe's blocks:
``even4`` (DINOv2's / DINOv3's ``FOUR_EVEN_INTERVALS``: ``i * (n // 4) - 1`` for i = 1..4, e.g.
[2, 5, 8, 11] of 12 blocks; 24 blocks give the reference's forced [4, 11, 17, 23]), ``last4``
(``FOUR_LAST``) or ``last``.

>>> parse_layer_list("even4", 12), parse_layer_list("even4", 24), parse_layer_list("last4", 12)
([2, 5, 8, 11], [4, 11, 17, 23], [8, 9, 10, 11])
>>> parse_layers_spec("layers:tokens:even4", 12), layer_tokens_spec("layers:tokens:even4")
(([2, 5, 8, 11], False), True)

The module path of each layer (e.g. ``blocks.3``, ``stages.2``) and whether the norm was applied
are recorded in the kind's provenance by the extraction; this module only spells and parses.
Layers of different widths are separate arrays, never padded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from featcache.errors import ConfigError

#: the parts a layer kind can hold, in the order a sweep prefers them when the part is "auto"
LAYER_PARTS = ("cls", "avg", "mean", "cls_raw", "mean_raw")
#: the per-block token part (dense heads): a kind of its own, outside the sweeps' LAYER_PARTS
TOKEN_PART = "tokens"
_KIND_RE = re.compile(r"^layer(\d+)_(cls_raw|mean_raw|cls|mean|avg|tokens)$")
_SPEC_RE = re.compile(r"^layers(?:\+raw)?:(?:tokens:)?(.+)$")
#: the recipes' block sets (dinov3/eval/depth/models/encoder.py:22-51, _get_backbone_out_indices)
_RECIPES = ("even4", "last4", "last")


def layer_kind(index: int, part: str) -> str:
    """The stored kind name of layer ``index``'s ``part`` (``layer3_cls``)."""
    if part not in (*LAYER_PARTS, TOKEN_PART):
        raise ConfigError(f"layer part {part!r} is not one of {', '.join((*LAYER_PARTS, TOKEN_PART))}")
    if index < 0:
        raise ConfigError(f"layer index {index} must be resolved to >= 0 before naming a kind")
    return f"layer{index}_{part}"


def parse_layer_kind(kind: str) -> tuple[int, str] | None:
    """``(index, part)`` for a layer kind (``layer3_cls`` -> ``(3, "cls")``), None otherwise."""
    m = _KIND_RE.match(kind)
    return (int(m[1]), m[2]) if m else None


def is_layers_spec(spec: str) -> bool:
    """Whether a ``--features`` entry is a per-layer request (``layers:all``, ``layers:1,4,-1``,
    ``layers+raw:all``)."""
    return _SPEC_RE.match(spec) is not None


def parse_layer_list(text: str, n_layers: int, flag: str = "--layers") -> list[int]:
    """``all`` or a comma list of indices (negative from the end) -> sorted unique 0-based
    indices, each checked against ``n_layers``; a bad entry is a one-line error naming ``flag``."""
    text = text.strip()
    if text == "all":
        return list(range(n_layers))
    if text in _RECIPES:
        return recipe_layers(text, n_layers, flag)
    out: set[int] = set()
    for tok in text.split(","):
        tok = tok.strip()
        try:
            i = int(tok)
        except ValueError:
            raise ConfigError(
                f"{flag} {text!r}: {tok!r} is not a layer index; write all, a comma list such as 1,4,-1, "
                "or a recipe's blocks: even4, last4, last"
            ) from None
        j = i + n_layers if i < 0 else i
        if not 0 <= j < n_layers:
            raise ConfigError(f"{flag} {text!r}: layer {i} is out of range for {n_layers} layers (0..{n_layers - 1})")
        out.add(j)
    return sorted(out)


def recipe_layers(name: str, n_layers: int, flag: str = "--layers") -> list[int]:
    """A recipe's blocks of an ``n_layers`` model, as DINOv3's ``_get_backbone_out_indices``
    computes them (``dinov3/eval/depth/models/encoder.py:22-51``, its ViT-L quirk kept)."""
    if name == "last":
        return [n_layers - 1]
    if n_layers < 4:
        raise ConfigError(f"{flag} {name}: the model has {n_layers} layers; {name} needs at least 4")
    if name == "last4":
        return list(range(n_layers - 4, n_layers))
    if n_layers == 24:  # the reference's forced (incorrect) ViT-L indices, for backward compatibility
        return [4, 11, 17, 23]
    return [i * (n_layers // 4) - 1 for i in range(1, 5)]


def layer_tokens_spec(spec: str) -> bool:
    """Whether a ``--features`` layers entry asks for per-block patch tokens
    (``layers:tokens:LIST``: ``layer{i}_tokens`` and ``layer{i}_cls``)."""
    return is_layers_spec(spec) and spec.split(":", 2)[1] == TOKEN_PART and spec.count(":") >= 2


def parse_layers_spec(spec: str, n_layers: int) -> tuple[list[int], bool]:
    """A ``--features`` layers entry -> (0-based indices, whether the pre-norm ``_raw`` parts are
    stored too)."""
    m = _SPEC_RE.match(spec)
    if m is None:
        raise ConfigError(
            f"{spec!r} is not a layers request; write layers:all, layers:1,4,-1 or layers:tokens:even4 (--features)"
        )
    return parse_layer_list(m[1], n_layers, flag="--features layers"), spec.startswith("layers+raw")


def stored_layers(kinds: Iterable[str], part: str = "auto") -> list[tuple[int, str]]:
    """The ``(index, kind)`` pairs of one part among ``kinds``, by index; ``part="auto"`` takes
    the first of :data:`LAYER_PARTS` that any stored layer has."""
    parsed = [(p, k) for k in kinds if (p := parse_layer_kind(k)) is not None]
    if part == "auto":
        present = {p[1] for p, _ in parsed}
        part = next((q for q in LAYER_PARTS if q in present), "")
    elif part not in LAYER_PARTS:
        raise ConfigError(f"layer part {part!r} is not one of auto, {', '.join(LAYER_PARTS)} (--layer-part)")
    return sorted((p[0], k) for p, k in parsed if p[1] == part)


def select_layers(kinds: Sequence[str], layers: str, part: str = "auto") -> list[tuple[int, str]]:
    """The stored layers a sweep runs on: ``layers`` is ``all`` or a comma list of layer indices
    (a non-negative index names the model's layer and must be stored; a negative one counts from
    the last stored layer); one line naming what is stored when something is missing."""
    avail = stored_layers(kinds, part)
    if not avail:
        raise ConfigError(
            f"no per-layer kinds (part {part}) are stored; kinds present: {list(kinds)}; extract them with "
            "--features layers:all (or layers:1,4,-1) first"
        )
    if layers.strip() == "all":
        return avail
    by_index = dict(avail)
    picked: dict[int, str] = {}
    for tok in layers.split(","):
        try:
            i = int(tok.strip())
        except ValueError:
            raise ConfigError(
                f"--layers {layers!r}: {tok.strip()!r} is not a layer index; write all or e.g. 1,4,-1"
            ) from None
        if i < 0:
            if -i > len(avail):
                raise ConfigError(f"--layers {layers!r}: {i} is past the {len(avail)} stored layers")
            i = avail[i][0]
        if i not in by_index:
            raise ConfigError(
                f"--layers {layers!r}: layer {i} is not stored; stored layers: {sorted(by_index)}; "
                "extract it with --features layers:LIST"
            )
        picked[i] = by_index[i]
    return sorted(picked.items())
