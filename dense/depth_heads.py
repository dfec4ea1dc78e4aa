"""The linear depth heads on stored token grids (torch modules).

- DINOv3's NYU linear head (``dinov3/eval/depth/models/linear_head.py`` with config-nyu.yaml:
  ``use_cls_token: False``, ``use_batchnorm: True``, 256 output channels): the last block's
  patch tokens, BatchNorm, a 1x1 conv initialised N(0, 0.01) with bias 0, at the token grid.
- DINOv2's ``lin. 1`` / ``lin. 4`` (``dinov2/eval/depth/models/decode_heads/linear_head.py``
  ``BNHead`` as ``dinov2/hub/depthers.py:53-67`` builds it): per block the class token
  concatenated to every patch token, the blocks bilinearly upsampled 4x and concatenated, no
  BatchNorm (it is commented out there), a 1x1 conv with torch's default initialisation. The conv
  is applied before the upsampling here: a 1x1 conv and a bilinear resize (weights summing to 1)
  commute, and the 256 bin channels are far fewer than the concatenated features.

Both turn the 256 bin logits into metres as :func:`bins_to_depth` (dinov3
``models/__init__.py:75-110``, ``bins_strategy="linear"``, ``norm_strategy="linear"``; the same
as DINOv2's ``decode_head.py:155-177`` "UD" + "linear").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from featcache.errors import ProtocolError

__all__ = ["DepthLinearHead", "bins_to_depth"]

#: dinov3 models/__init__.py:95 / DINOv2 decode_head.py:168: added to the relu'd bin logits
BIN_EPS = 0.1


def bins_to_depth(logits: torch.Tensor, min_depth: float, max_depth: float) -> torch.Tensor:
    """``[B, K, h, w]`` bin logits -> ``[B, 1, h, w]`` metres: ``relu + 0.1``, normalised over
    the bins, times ``linspace(min_depth, max_depth, K)`` summed (AdaBins' linear norm)."""
    bins = torch.linspace(min_depth, max_depth, logits.shape[1], device=logits.device)
    w = torch.relu(logits) + BIN_EPS
    w = w / w.sum(dim=1, keepdim=True)
    return torch.einsum("ikmn,k->imn", w, bins).unsqueeze(dim=1)


def _lerp_matrix(n: int, factor: int, like: torch.Tensor) -> torch.Tensor:
    """``[n * factor, n]``: ``F.interpolate(..., mode="bilinear", align_corners=False)`` along one
    axis as a matrix (the resize is separable: ``A_h @ x @ A_w.T`` equals it up to rounding, and
    its backward is several times faster on CPUs than the interpolation kernel's)."""
    eye = torch.eye(n, dtype=like.dtype, device=like.device)[None, None]
    return F.interpolate(eye, size=(n * factor, n), mode="bilinear", align_corners=False)[0, 0]


class DepthLinearHead(nn.Module):
    """A linear depth head over ``n_blocks`` blocks of width ``dim``.

    ``use_cls``: the class token concatenated to each patch token (DINOv2); ``batchnorm``:
    BatchNorm2d before the conv (DINOv3); ``upsample``: the factor the bin logits are bilinearly
    upsampled by before the depth is read out (DINOv2: 4); ``init_std``: N(0, std) weights and
    zero bias (DINOv3: 0.01; None: torch's default). :meth:`forward` takes the blocks' patch
    grids ``[B, dim, gh, gw]`` (and class tokens ``[B, dim]``) and returns ``[B, 1, h, w]``
    metres at ``upsample`` x the grid."""

    def __init__(
        self,
        dim: int,
        n_blocks: int = 1,
        *,
        use_cls: bool = False,
        batchnorm: bool = True,
        upsample: int = 1,
        n_bins: int = 256,
        min_depth: float = 1e-3,
        max_depth: float = 10.0,
        init_std: float | None = 0.01,
    ) -> None:
        super().__init__()
        self.channels = dim * n_blocks * (2 if use_cls else 1)
        self.use_cls, self.upsample = bool(use_cls), int(upsample)
        self.min_depth, self.max_depth = float(min_depth), float(max_depth)
        self.bn: nn.Module = nn.BatchNorm2d(self.channels) if batchnorm else nn.Identity()
        self.conv = nn.Conv2d(self.channels, n_bins, kernel_size=1)
        if init_std is not None:
            nn.init.normal_(self.conv.weight, mean=0, std=init_std)
            if self.conv.bias is not None:
                nn.init.constant_(self.conv.bias, 0)

    def features(self, patches: Sequence[torch.Tensor], cls: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The concatenated ``[B, channels, gh, gw]`` input of the conv (the reference's
        ``_forward_feature``: per block ``cat(patch, cls expanded)``, then ``cat`` over blocks)."""
        parts = []
        for i, x in enumerate(patches):
            if self.use_cls:
                if cls is None:
                    raise ProtocolError(
                        "this depth head concatenates the class token: pass the blocks' class tokens (cls)"
                    )
                parts.append(torch.cat((x, cls[i][:, :, None, None].expand_as(x)), 1))
            else:
                parts.append(x)
        return torch.cat(parts, dim=1)

    def logits(self, patches: Sequence[torch.Tensor], cls: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The bin logits at ``upsample`` x the grid."""
        out = self.conv(self.bn(self.features(patches, cls)))
        if self.upsample != 1:
            gh, gw = out.shape[2:]
            out = _lerp_matrix(gh, self.upsample, out) @ out @ _lerp_matrix(gw, self.upsample, out).T
        return out

    def forward(self, patches: Sequence[torch.Tensor], cls: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        return bins_to_depth(self.logits(patches, cls), self.min_depth, self.max_depth)
