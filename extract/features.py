"""Feature kinds computed from one forward pass (pooled, tokens_mean, cls, stageN_avg)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from featcache.errors import ConfigError, FeatcacheError

if TYPE_CHECKING:
    import torch

    from featcache.models.model import Backbone

FEATURE_KINDS_HELP = "pooled, tokens_mean, cls, stageN_avg (N = stage index)"
_STAGE_RE = re.compile(r"^stage(\d+)_avg$")


class FeatureHead:
    """Computes several feature kinds from ONE forward pass."""

    def __init__(self, backbone: Backbone, kinds: Sequence[str]) -> None:
        self.bb = backbone
        self.model = backbone.model
        self.kinds = list(dict.fromkeys(kinds))
        if not self.kinds:
            raise FeatcacheError(f"no feature kinds requested; choose from {FEATURE_KINDS_HELP}")
        self.stages: list[int] = []
        self.features_fn = getattr(backbone, "features_fn", None)
        if self.features_fn is not None:  # a non-timm source computes its own kinds
            bad = [k for k in self.kinds if k not in backbone.kinds]
            if bad:
                raise ConfigError(
                    f"{backbone.name} offers {', '.join(backbone.kinds)}; not {', '.join(bad)}: choose from those "
                    "(--features / features=)"
                )
            return
        for k in self.kinds:
            m = _STAGE_RE.match(k)
            if m:
                self.stages.append(int(m.group(1)))
            elif k not in ("pooled", "tokens_mean", "cls"):
                raise FeatcacheError(f"unknown feature kind {k!r}; choose from {FEATURE_KINDS_HELP}")
        if self.stages and not hasattr(self.model, "forward_intermediates"):
            raise FeatcacheError(f"{backbone.name} has no forward_intermediates; stageN_avg kinds are unavailable")
        self.n_prefix = int(getattr(self.model, "num_prefix_tokens", 1 if hasattr(self.model, "cls_token") else 0))

    def __call__(self, x: torch.Tensor) -> dict[str, Any]:
        if self.features_fn is not None:
            return self.features_fn(x, self.kinds)
        m = self.model
        inter = {}
        if self.stages:
            final, feats = m.forward_intermediates(x, indices=sorted(set(self.stages)))
            inter = dict(zip(sorted(set(self.stages)), feats))
        else:
            final = m.forward_features(x)
        out = {}
        for k in self.kinds:
            if k == "pooled":
                out[k] = m.forward_head(final, pre_logits=True)
            elif k in ("tokens_mean", "cls"):
                if final.ndim != 3:
                    raise FeatcacheError(
                        f"{k} needs a token (transformer) backbone; {self.bb.name} outputs {tuple(final.shape)}"
                    )
                if k == "cls":
                    if self.n_prefix < 1:
                        raise FeatcacheError(f"{self.bb.name} has no class token; use pooled or tokens_mean")
                    out[k] = final[:, 0]
                else:
                    out[k] = final[:, self.n_prefix :].mean(dim=1)
            else:
                stage = _STAGE_RE.match(k)
                assert stage is not None  # the kind was validated as stageN
                t = inter[int(stage.group(1))]
                out[k] = t.mean(dim=(2, 3)) if t.ndim == 4 else t.mean(dim=1)
        return out

    def dims(self, shape: tuple[int, ...]) -> dict[str, int]:
        import torch

        with torch.inference_mode():
            x = torch.zeros((1, *shape), device=self.bb.device)
            if self.stages:
                self._check_stages(x)
            return {k: int(v.shape[-1]) for k, v in self(x).items()}

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
