"""The depth heads' losses and learning-rate schedule, as the references define them.

- :class:`SigLoss`: facebookresearch/dinov3 ``dinov3/eval/depth/loss.py:102-136`` (AdaBins'
  scale-invariant log loss; ``LossType.SIGLOSS`` builds it with ``warm_up=True, warm_iter=100``,
  loss.py:16-20: for the first 100 calls only ``0.15 * mean(g)**2`` enters). DINOv2's
  ``dinov2/eval/depth/models/losses/sigloss.py`` is the same number on the same valid pixels.
- :func:`gradient_log_loss`: DINOv2's ``GradientLoss`` (``losses/gradientloss.py:33-63``, the
  MegaDepth log-gradient loss at 4 scales) computed over the last two (spatial) axes with an
  explicit valid mask, as dinov3's ``GradientLogLoss`` (loss.py:57-88) writes it. DINOv2 indexes
  ``input[::2*i, ::2*i]`` and ``[0:-2, :]`` on the leading axes, which on its ``[B, 1, H, W]``
  predictions are the batch and channel axes (a zero loss for a batch of 2 per GPU); featcache
  follows the evident intent (tests/dense/test_depth_ports.py reproduces both).
- :func:`warmup_one_cycle`: dinov3 ``schedulers.py:30-152`` ``WarmupOneCycleLR`` (cosine
  anneal, no warm-up ratio): the learning rate and Adam's beta1 of every step. The reference sets
  beta1 to the schedule's ``momentum``, which is 0 during the warm-up (schedulers.py:101,148);
  featcache reproduces that.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SigLoss", "gradient_log_loss", "warmup_one_cycle"]

#: dinov3 loss.py:112 / DINOv2 sigloss.py:35: added before each log
LOSS_EPS = 1e-3


class SigLoss:
    """The scale-invariant log loss with the reference's warm-up counter (one call = one step).

    ``__call__(pred, target, valid)``: ``pred``/``target`` tensors of one shape, ``valid`` a bool
    mask of that shape (None: every pixel). Returns a 0-dim tensor."""

    def __init__(self, warm_up: bool = True, warm_iter: int = 100) -> None:
        self.warm_up = bool(warm_up)
        self.warm_iter = int(warm_iter)
        self.counter = 0

    def __call__(self, pred: Any, target: Any, valid: Any = None) -> Any:
        import torch

        if valid is not None:
            pred, target = pred[valid], target[valid]
        g = torch.log(pred + LOSS_EPS) - torch.log(target + LOSS_EPS)
        dg = 0.15 * torch.pow(torch.mean(g), 2)
        if self.warm_up and self.counter < self.warm_iter:
            self.counter += 1
        else:
            dg = dg + torch.var(g)
        if dg <= 0:
            return torch.abs(dg)
        return torch.sqrt(dg)


def gradient_log_loss(pred: Any, target: Any, valid: Any) -> Any:
    """MegaDepth's multi-scale log-gradient loss over the last two axes (see the module doc):
    at strides 1, 2, 4, 6, the absolute difference of the masked log-depth error between pixels
    two apart, vertically and horizontally, summed and divided by the valid pixels of that scale."""
    import torch

    mask = valid.to(pred.dtype)
    scales = [(pred, target, mask)] + [
        (pred[..., :: 2 * i, :: 2 * i], target[..., :: 2 * i, :: 2 * i], mask[..., :: 2 * i, :: 2 * i])
        for i in range(1, 4)
    ]
    loss = pred.new_zeros(())
    for p, t, m in scales:
        n = torch.sum(m)
        d = (torch.log(p + LOSS_EPS) - torch.log(t + LOSS_EPS)) * m
        v = torch.abs(d[..., 0:-2, :] - d[..., 2:, :]) * (m[..., 0:-2, :] * m[..., 2:, :])
        h = torch.abs(d[..., :, 0:-2] - d[..., :, 2:]) * (m[..., :, 0:-2] * m[..., :, 2:])
        loss = loss + (torch.sum(h) + torch.sum(v)) / n
    return loss


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def warmup_one_cycle(
    step: int,
    total_steps: int,
    warmup_iters: int,
    max_lr: float,
    *,
    div_factor: float = 25.0,
    final_div_factor: float = 1000.0,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
) -> tuple[float, float]:
    """``(lr, beta1)`` of optimiser step ``step`` (0-based) under dinov3's ``WarmupOneCycleLR``
    with ``anneal_strategy="cos"`` and no ``warmup_ratio``: during the warm-up
    ``max_lr / final_div_factor + max_lr * (1 + cos(pi step / total)) / 2 * step / warmup`` and
    beta1 0; after it a cosine from ``max_lr`` to ``max_lr / div_factor / final_div_factor`` at
    ``(step + 1) / total`` and beta1 annealed from ``base_momentum`` to ``max_momentum``."""
    if step < warmup_iters:
        gmax = max_lr * (1 + math.cos(math.pi * step / float(total_steps))) / 2
        return max_lr / final_div_factor + gmax * step / float(warmup_iters), 0.0
    pct = (step - warmup_iters) / float(total_steps - warmup_iters)
    momentum = _anneal_cos(base_momentum, max_momentum, pct)
    min_lr = max_lr / div_factor / final_div_factor
    return _anneal_cos(max_lr, min_lr, (step + 1) / float(total_steps)), momentum
