"""Per-layer features (issue 56): which layers a backbone can give from its one forward pass,
what ``--features layers:all|LIST`` and ``layers+raw:...`` expand to, and what each layer kind's
provenance records. The kind names are :mod:`featcache.core.layers`'; the timm head
(:class:`featcache.extract.features.FeatureHead`) and the sources that compute their own kinds
(``open_clip:``, ``hf:``) describe their layers with a :class:`LayerSet`.

- a ViT block ``i``: ``layer{i}_cls`` (its class token) and ``layer{i}_mean`` (its mean patch
  token, prefix and register tokens excluded), both through the model's final norm over the
  block's whole output (DINOv2's ``get_intermediate_layers(norm=True)``); with ``layers+raw`` also
  ``layer{i}_cls_raw`` and ``layer{i}_mean_raw``, the same before the norm;
- a timm ViT block ``i`` with ``layers:tokens:LIST`` (issue 57): ``layer{i}_tokens``, its patch
  tokens ``[T, D]`` through the final norm (``forward_intermediates(norm=True)``), beside
  ``layer{i}_cls``; ``LIST`` may be a recipe's blocks (``even4``: DINOv2's evenly spaced blocks);
- a CNN stage ``i`` (timm's ``feature_info``): ``layer{i}_avg``, its global average (no norm);
- the model's own ``pooled`` output, always, from the same forward.

>>> s = LayerSet(("blocks.0", "blocks.1"), ("cls", "mean"), norm="norm", via="timm forward_intermediates")
>>> s.expand("layers:-1")
['pooled', 'layer1_cls', 'layer1_mean']
>>> s.record("layer1_cls_raw")["module"], s.record("layer1_cls_raw")["norm"]
('blocks.1', False)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from featcache.core.layers import (
    TOKEN_PART,
    is_layers_spec,
    layer_kind,
    layer_tokens_spec,
    parse_layer_kind,
    parse_layers_spec,
)
from featcache.errors import ConfigError

__all__ = ["LAYER_SOURCES", "LayerSet", "expand_kinds", "module_path", "no_layers", "timm_layers", "vit_layer_outputs"]

#: what gives per-layer kinds, in the words of every refusal
LAYER_SOURCES = (
    "timm models with forward_intermediates (ViT blocks: class and mean patch tokens; CNN stages: "
    "global averages), open_clip ViT image towers and Hugging Face vision towers (output_hidden_states), "
    "on --backend eager or compile"
)
_FLAG = "(--features / features=)"


def no_layers(name: str, why: str) -> ConfigError:
    """The one-line refusal of ``layers:...`` for a backbone (or backend) that cannot give them."""
    return ConfigError(
        f"per-layer kinds (layers:...): {name} {why}; they come from {LAYER_SOURCES}; "
        f"use pooled, stageN_avg or blocks:K where the model offers them {_FLAG}"
    )


@dataclass(frozen=True)
class LayerSet:
    """The layers of one backbone: ``modules[i]``, the module path of layer ``i`` (``blocks.3``);
    ``parts``, what each layer gives (``("cls", "mean")``, ``("mean",)`` without a class token,
    ``("avg",)`` for CNN stages); ``norm``, the module path of the final norm the ViT parts go
    through ("" where there is none: then no ``_raw`` parts); ``via``, the library's API used."""

    modules: tuple[str, ...]
    parts: tuple[str, ...]
    norm: str = ""
    via: str = ""
    #: whether each layer also gives its patch tokens (``layer{i}_tokens``: timm ViT blocks)
    tokens: bool = False

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def raw_parts(self) -> tuple[str, ...]:
        """The pre-norm parts ``layers+raw`` adds (none without a norm, so none for CNN stages)."""
        return tuple(f"{p}_raw" for p in self.parts if p in ("cls", "mean")) if self.norm else ()

    def offers(self, kind: str) -> bool:
        """Whether ``kind`` (``layer3_cls``) is one of this backbone's layer kinds."""
        p = parse_layer_kind(kind)
        extra = (TOKEN_PART,) if self.tokens else ()
        return p is not None and p[0] < len(self) and p[1] in (*self.parts, *self.raw_parts, *extra)

    def expand(self, spec: str) -> list[str]:
        """``pooled`` and the layer kinds of a ``layers:...`` / ``layers+raw:...`` entry, by layer."""
        indices, raw = parse_layers_spec(spec, len(self))
        if layer_tokens_spec(spec):
            if raw or not self.tokens:
                why = "layers+raw:tokens is not offered" if raw else "these layers give no patch tokens"
                raise ConfigError(f"--features {spec}: {why}; per-block tokens come from timm ViT blocks {_FLAG}")
            cls = ("cls",) if "cls" in self.parts else ()
            return [layer_kind(i, p) for i in indices for p in (TOKEN_PART, *cls)]
        if raw and not self.raw_parts:
            raise ConfigError(
                f"--features {spec}: these layers have no final norm, so there is nothing before it to store; "
                f"write {spec.replace('layers+raw', 'layers', 1)} {_FLAG}"
            )
        parts = (*self.parts, *(self.raw_parts if raw else ()))
        return ["pooled", *(layer_kind(i, p) for i in indices for p in parts)]

    def record(self, kind: str) -> dict[str, Any]:
        """What a layer kind's provenance records (its ``layer`` field): index, part, module path,
        whether the final norm was applied and which module it is, the API used."""
        p = parse_layer_kind(kind)
        if p is None or not self.offers(kind):
            raise ConfigError(f"{kind!r} is not a layer kind of this backbone {_FLAG}")
        normed = bool(self.norm) and p[1] in ("cls", "mean", TOKEN_PART)
        return {
            "index": p[0],
            "part": p[1],
            "module": self.modules[p[0]],
            "norm": normed,
            "norm_module": self.norm if normed else "",
            "via": self.via,
        }


def expand_kinds(kinds: Any, layers: LayerSet | None, name: str) -> list[str]:
    """``kinds`` with every ``layers:...`` entry replaced by what it stores (unique, in order);
    one line naming what gives layers when ``layers`` is None."""
    out: list[str] = []
    for k in kinds:
        if not is_layers_spec(k) and parse_layer_kind(k) is None:
            out.append(k)
            continue
        if layers is None or not len(layers):
            raise no_layers(name, "exposes no intermediate layers to featcache")
        if is_layers_spec(k):
            out += layers.expand(k)
        elif not layers.offers(k):
            raise ConfigError(
                f"feature kind {k!r}: {name} has layers 0..{len(layers) - 1} with parts "
                f"{', '.join((*layers.parts, *layers.raw_parts))} {_FLAG}"
            )
        else:
            out.append(k)
    return list(dict.fromkeys(out))


def module_path(root: Any, module: Any) -> str:
    """The dotted path of ``module`` inside ``root`` (``vision_model.encoder.layers.3``)."""
    return next((n for n, m in root.named_modules() if m is module), "")


def timm_layers(model: Any) -> LayerSet | None:
    """The layers of a timm model: a ViT's blocks (``forward_intermediates`` with prefix tokens;
    class and mean parts, or mean only without a class token) or the stages of ``feature_info``
    (global averages); None without ``forward_intermediates``."""
    import torch

    fi = getattr(model, "forward_intermediates", None)
    if fi is None:
        return None
    via = "timm forward_intermediates"
    blocks = getattr(model, "blocks", None)
    if blocks is not None and "return_prefix_tokens" in inspect.signature(fi).parameters:
        info = getattr(model, "feature_info", None) or []
        mods = [d.get("module", f"blocks.{i}") for i, d in enumerate(info)] if len(info) == len(blocks) else []
        has_cls = getattr(model, "cls_token", None) is not None and int(getattr(model, "num_prefix_tokens", 0)) >= 1
        norm = getattr(model, "norm", None)
        real_norm = isinstance(norm, torch.nn.Module) and not isinstance(norm, torch.nn.Identity)
        return LayerSet(
            tuple(mods or (f"blocks.{i}" for i in range(len(blocks)))),
            ("cls", "mean") if has_cls else ("mean",),
            norm="norm" if real_norm else "",
            via=via,
            tokens=True,
        )
    info = getattr(model, "feature_info", None)
    if not info:
        return None
    return LayerSet(tuple(str(d.get("module", f"stage{i}")) for i, d in enumerate(info)), ("avg",), via=via)


def vit_layer_outputs(records: dict[str, dict[str, Any]], got: dict[int, Any], norm: Any) -> dict[str, Any]:
    """The ViT layer kinds of ``records`` (kind -> :meth:`LayerSet.record`) from each block's
    ``(patch tokens [B, T, D], prefix tokens [B, P, D] or None)``: the class token (token 0) and
    the mean patch token of ``norm`` over the block's whole output, as DINOv2's
    ``get_intermediate_layers(norm=True)`` and timm's ``forward_intermediates(norm=True)`` compute
    them, or the same before the norm (``_raw``); one block at a time, its normed copy dropped
    before the next."""
    import torch

    out = {}
    for i in sorted({r["index"] for r in records.values()}):
        pair: tuple[Any, Any] = got[i]
        patches, prefix = pair
        n_pre = 0 if prefix is None else int(prefix.shape[1])
        mine = {k: r for k, r in records.items() if r["index"] == i}
        normed = None
        if any(r["norm"] for r in mine.values()):
            normed = norm(patches if prefix is None else torch.cat([prefix, patches], dim=1))
        for k, r in mine.items():
            src = normed if r["norm"] else None
            if r["part"] == TOKEN_PART:  # the block's patch tokens [B, T, D], normed (a copy, as below)
                out[k] = (src[:, n_pre:] if src is not None else patches).clone()
            elif r["part"].startswith("cls"):
                # a copy: the token's view would keep the block's whole [B, P + T, D] output alive
                seq: Any = src if src is not None else prefix  # a class-token part: prefix tokens exist
                out[k] = seq[:, 0].clone()
            else:
                out[k] = src[:, n_pre:].mean(dim=1) if src is not None else patches.mean(dim=1)
        del normed
    return {k: out[k] for k in records}
