"""Feature kinds computed from one forward pass: the vectors (pooled, tokens_mean, cls,
stageN_avg), the token kinds of :mod:`featcache.models.sources.tokens` (blocks:K, tokens,
tokens@GxG), whose per-row shapes are ``(K, D)``, ``(T, D)`` and ``(G*G, D)``, and the per-layer
kinds of :mod:`featcache.models.sources.layers` (``layers:all|LIST`` expands to ``layer{i}_cls``,
``layer{i}_mean``, ``layer{i}_avg``, ... before any image is read)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from featcache.core.layers import is_layers_spec, parse_layer_kind
from featcache.errors import ConfigError, FeatcacheError
from featcache.models.sources.layers import LayerSet, expand_kinds, timm_layers, vit_layer_outputs
from featcache.models.sources.tokens import (
    check_blocks,
    grid_pool,
    kind_template,
    map_pool,
    map_tokens,
    no_class_token,
    parse_token_kind,
    token_grid,
)

if TYPE_CHECKING:
    import torch

    from featcache.models.model import Backbone

FEATURE_KINDS_HELP = (
    "pooled, tokens_mean, cls, stageN_avg (N = stage index), blocks:K (class tokens of the last K blocks), "
    "tokens (patch tokens), tokens@GxG (tokens area-pooled to G x G), layers:all|LIST and layers+raw:all|LIST "
    "(per-layer layer{i}_cls/_mean/_avg kinds and pooled), layers:tokens:LIST (per-block normed patch tokens "
    "layer{i}_tokens with layer{i}_cls; LIST may be even4, last4, last)"
)
_STAGE_RE = re.compile(r"^stage(\d+)_avg$")


class FeatureHead:
    """Computes several feature kinds from ONE forward pass."""

    def __init__(self, backbone: Backbone, kinds: Sequence[str]) -> None:
        self.bb = backbone
        self.model = backbone.model
        self.features_fn = getattr(backbone, "features_fn", None)
        self.kinds = self._expand(list(dict.fromkeys(kinds)))
        if not self.kinds:
            raise FeatcacheError(f"no feature kinds requested; choose from {FEATURE_KINDS_HELP}")
        self.stages: list[int] = []
        self.blocks = 0  # the largest K of the blocks:K kinds asked for (0: none)
        if self.features_fn is not None:  # a non-timm source computes its own kinds
            bad = [k for k in self.kinds if kind_template(k) not in backbone.kinds and k not in self.layer_records]
            if bad:
                raise ConfigError(
                    f"{backbone.name} offers {', '.join(backbone.kinds)}; not {', '.join(bad)}: choose from those "
                    "(--features / features=)"
                )
            return
        for k in self.kinds:
            m = _STAGE_RE.match(k)
            tok = parse_token_kind(k)
            if m:
                self.stages.append(int(m.group(1)))
            elif tok is not None:
                self.blocks = max(self.blocks, tok[1]) if tok[0] == "blocks" else self.blocks
            elif k not in ("pooled", "tokens_mean", "cls", *self.layer_records):
                raise FeatcacheError(f"unknown feature kind {k!r}; choose from {FEATURE_KINDS_HELP}")
        if self.stages and not hasattr(self.model, "forward_intermediates"):
            raise FeatcacheError(f"{backbone.name} has no forward_intermediates; stageN_avg kinds are unavailable")
        self.n_prefix = int(getattr(self.model, "num_prefix_tokens", 1 if hasattr(self.model, "cls_token") else 0))
        if self.blocks:
            self._check_blocks()

    def _expand(self, kinds: list[str]) -> list[str]:
        """``kinds`` with each ``layers:...`` entry expanded (:mod:`featcache.models.sources.layers`);
        sets ``layers`` (the backbone's :class:`LayerSet`, None where no layer kind is asked) and
        ``layer_records`` (layer kind -> what its provenance records)."""
        self.layers: LayerSet | None = None
        self.layer_records: dict[str, dict[str, Any]] = {}
        if not any(is_layers_spec(k) or parse_layer_kind(k) is not None for k in kinds):
            return kinds
        has = self.features_fn is not None
        self.layers = getattr(self.bb, "layers", None) if has else timm_layers(self.model)
        out = expand_kinds(kinds, self.layers, self.bb.name)
        assert self.layers is not None  # expand_kinds refuses a backbone without layers
        self.layer_records = {k: self.layers.record(k) for k in out if parse_layer_kind(k) is not None}
        return out

    def _check_blocks(self) -> None:
        """blocks:K needs a class token, timm's forward_intermediates with prefix tokens, K <= blocks."""
        m, name = self.model, self.bb.name
        if getattr(m, "cls_token", None) is None or self.n_prefix < 1:
            raise no_class_token(name)
        fi = getattr(m, "forward_intermediates", None)
        if fi is None or "return_prefix_tokens" not in inspect.signature(fi).parameters or not hasattr(m, "blocks"):
            raise no_class_token(name, "gives no per-block prefix tokens (timm forward_intermediates)")
        check_blocks(self.blocks, len(m.blocks), name)

    def __call__(self, x: torch.Tensor) -> dict[str, Any]:
        if self.features_fn is not None:
            return self.features_fn(x, self.kinds)
        final, inter, cls, layer_out = self._forward(x)
        out = {}
        for k in self.kinds:
            if k == "pooled":
                out[k] = self.model.forward_head(final, pre_logits=True)
            elif k in layer_out:
                out[k] = layer_out[k]
            elif k in ("tokens_mean", "cls"):
                out[k] = self._vector_token_kind(k, final)
            elif (tok := parse_token_kind(k)) is not None:
                kind, n = tok
                out[k] = cls[:, cls.shape[1] - n :] if kind == "blocks" else self._tokens(final, x, n)
            else:
                stage = _STAGE_RE.match(k)
                assert stage is not None  # the kind was validated as stageN
                out[k] = _average(inter[int(stage.group(1))])
        return out

    def _forward(self, x: torch.Tensor) -> tuple[Any, dict[int, Any], Any, dict[str, Any]]:
        """(final features, stage index -> intermediate, class tokens ``[B, K, D]`` of the last
        K blocks through the final norm, or None, the per-layer kinds), all from one forward pass."""
        import torch

        m = self.model
        layer_idx = sorted({p[0] for k in self.layer_records if (p := parse_layer_kind(k)) is not None})
        vit_layers = layer_idx if self.layers is not None and self.layers.parts != ("avg",) else []
        if not self.blocks and not vit_layers:  # the forward of the vector kinds (and CNN stages)
            stages = sorted(set(self.stages) | set(layer_idx))
            if stages:
                final, feats = m.forward_intermediates(x, indices=stages)
                got = dict(zip(stages, feats))
                return final, got, None, {k: _average(got[r["index"]]) for k, r in self.layer_records.items()}
            return m.forward_features(x), {}, None, {}
        n = len(m.blocks)
        last = list(range(n - self.blocks, n))
        take = sorted(set(self.stages) | set(last) | set(vit_layers))
        final, feats = m.forward_intermediates(
            x, indices=take, norm=False, return_prefix_tokens=True, output_fmt="NLC"
        )  # fmt: skip
        # block -> (patch tokens, prefix tokens or None: timm gives no pair without prefix tokens)
        got: dict[int, tuple[Any, Any]] = {i: f if isinstance(f, tuple) else (f, None) for i, f in zip(take, feats)}
        cls = None
        if self.blocks:  # DINOv2's get_intermediate_layers(norm=True): the final norm over the block's whole output
            cls = torch.stack([m.norm(torch.cat([got[i][1], got[i][0]], dim=1))[:, 0] for i in last], dim=1)
        return (
            final,
            {i: self._nchw(got[i][0], x) for i in self.stages},
            cls,
            vit_layer_outputs(self.layer_records, got, m.norm),
        )

    def _nchw(self, t: Any, x: Any) -> Any:
        """NLC patch tokens as timm's NCHW intermediates (what stageN_avg averages)."""
        h, w = self.model.patch_embed.dynamic_feat_size(tuple(x.shape[-2:]))
        return t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()

    def _vector_token_kind(self, k: str, final: Any) -> Any:
        if final.ndim != 3:
            raise FeatcacheError(
                f"{k} needs a token (transformer) backbone; {self.bb.name} outputs {tuple(final.shape)}"
            )
        if k == "cls":
            if self.n_prefix < 1:
                raise FeatcacheError(f"{self.bb.name} has no class token; use pooled or tokens_mean")
            return final[:, 0]
        return final[:, self.n_prefix :].mean(dim=1)

    def _tokens(self, final: Any, x: Any, g: int) -> Any:
        """``tokens`` (g == 0) or ``tokens@GxG``: a ViT's patch tokens through the final norm
        (prefix/register tokens excluded), or a CNN's final map positions."""
        name = self.bb.name
        if final.ndim == 4:  # a feature map: NCHW, or NHWC where timm says so (Swin)
            fmap = final.permute(0, 3, 1, 2) if getattr(self.model, "output_fmt", "NCHW") == "NHWC" else final
            return map_tokens(fmap) if g == 0 else map_pool(fmap, g, name)
        if final.ndim != 3:
            raise FeatcacheError(f"tokens need a token or feature-map backbone; {name} outputs {tuple(final.shape)}")
        patches = final[:, self.n_prefix :]
        if g == 0:
            return patches
        pe = getattr(self.model, "patch_embed", None)
        hw = pe.dynamic_feat_size(tuple(x.shape[-2:])) if pe is not None and hasattr(pe, "dynamic_feat_size") else None
        return grid_pool(patches, token_grid(patches.shape[1], hw, name), g, name)

    def dims(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each kind's per-row shape, e.g. ``{"pooled": (1280,), "blocks:4": (4, 192)}``, from
        one forward of a zero image of ``shape`` (C, H, W); refuses kinds the model cannot give."""
        import torch

        with torch.inference_mode():
            x = torch.zeros((1, *shape), device=self.bb.device)
            if self.stages:
                self._check_stages(x)
            return {k: tuple(int(s) for s in v.shape[1:]) for k, v in self(x).items()}

    def _check_stages(self, x) -> None:
        """timm asserts on a stage index out of range; name the kind and the stages there are."""
        stages = sorted(set(self.stages))
        info = getattr(self.model, "feature_info", None)
        if info:  # timm's stage list: no extra forward pass
            n = len(info)
        else:
            try:
                n = len(self.model.forward_intermediates(x, indices=None, intermediates_only=True))
            except TypeError:  # a model whose forward_intermediates takes no intermediates_only
                return
        bad = [i for i in stages if i >= n]
        if bad:
            raise ConfigError(
                f"feature kind(s) {', '.join(f'stage{i}_avg' for i in bad)}: {self.bb.name} has stages "
                f"0..{n - 1}; choose stageN_avg with N in 0..{n - 1} (--features / features=)"
            )


def _average(t: Any) -> Any:
    """A stage's global average: over H, W of an NCHW map, over the tokens of an NLC one."""
    return t.mean(dim=(2, 3)) if t.ndim == 4 else t.mean(dim=1)
