"""featcache's depth heads, losses and schedule vs ports of the code that defines them, on the same
tensors, at 1 and 2 torch threads (the tolerances are float32 rounding).

Ported (bodies kept, argument handling trimmed; order of operations unchanged):
- facebookresearch/dinov3 @ 6876159a11b4df116f30f667f8c9888617df0751
  ``dinov3/eval/depth/loss.py:57-88`` (GradientLogLoss), ``:102-136`` (SigLoss), ``:16-20``
  (SIGLOSS's warm_up=True, warm_iter=100); ``models/linear_head.py:11-98`` (LinearHead);
  ``models/__init__.py:75-110`` (FeaturesToDepth, linear bins, linear norm);
  ``schedulers.py:19-152`` (WarmupOneCycleLR); ``transforms.py:153-161``
  (LeftRightFlipAug.inverse); ``eval.py:120-186`` (the evaluation order).
- facebookresearch/dinov2 @ b8931f7bf91576930313be2c6d6af376033b35f0
  ``dinov2/eval/depth/models/decode_heads/linear_head.py:14-89`` (BNHead),
  ``decode_heads/decode_head.py:155-177`` (depth_pred), ``losses/gradientloss.py:33-63``,
  ``losses/sigloss.py:42-59``, ``dinov2/hub/depthers.py:22-67`` (the linear depth head's
  depth range).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from featcache.core.dense_metrics import DepthAccumulator
from featcache.dense.depth_heads import DepthLinearHead, bins_to_depth
from featcache.dense.depth_losses import SigLoss, gradient_log_loss, warmup_one_cycle


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


# ------------------------------------------------------------------ dinov3 ports
class RefSigLoss(nn.Module):
    """dinov3 loss.py:102-136."""

    def __init__(self, warm_up=True, warm_iter=100):
        super().__init__()
        self.eps = 0.001
        self.warm_up = warm_up
        self.warm_iter = warm_iter
        self.warm_up_counter = 0

    def sigloss(self, input, target, valid_mask=None):
        if valid_mask is None:
            valid_mask = torch.ones_like(target, dtype=bool)
        input = input[valid_mask]
        target = target[valid_mask]
        g = torch.log(input + self.eps) - torch.log(target + self.eps)
        Dg = 0.15 * torch.pow(torch.mean(g), 2)
        if self.warm_up and self.warm_up_counter < self.warm_iter:
            self.warm_up_counter += 1
        else:
            Dg += torch.var(g)
        if Dg <= 0:
            return torch.abs(Dg)
        return torch.sqrt(Dg)

    def forward(self, depth_pred, depth_gt, valid_mask=None):
        return self.sigloss(depth_pred, depth_gt, valid_mask)


class RefGradientLogLoss(nn.Module):
    """dinov3 loss.py:57-88."""

    def __init__(self):
        super().__init__()
        self.eps = 0.001

    def forward(self, input, target, valid_mask=None):
        input_downscaled = [input] + [input[..., :: 2 * i, :: 2 * i] for i in range(1, 4)]
        target_downscaled = [target] + [target[..., :: 2 * i, :: 2 * i] for i in range(1, 4)]
        mask_downscaled = [valid_mask] + [valid_mask[..., :: 2 * i, :: 2 * i] for i in range(1, 4)]
        gradient_loss = 0
        for input, target, mask in zip(input_downscaled, target_downscaled, mask_downscaled):
            N = torch.sum(mask)
            input_log = torch.log(input + self.eps)
            target_log = torch.log(target + self.eps)
            log_d_diff = input_log - target_log
            log_d_diff = torch.mul(log_d_diff, mask)
            v_gradient = torch.abs(log_d_diff[..., 0:-2, :] - log_d_diff[..., 2:, :])
            v_mask = torch.mul(mask[..., 0:-2, :], mask[..., 2:, :])
            v_gradient = torch.mul(v_gradient, v_mask)
            h_gradient = torch.abs(log_d_diff[..., :, 0:-2] - log_d_diff[..., :, 2:])
            h_mask = torch.mul(mask[..., :, 0:-2], mask[..., :, 2:])
            h_gradient = torch.mul(h_gradient, h_mask)
            gradient_loss += (torch.sum(h_gradient) + torch.sum(v_gradient)) / N
        return gradient_loss


class RefLinearHead(nn.Module):
    """dinov3 models/linear_head.py:11-98 (SyncBatchNorm is BatchNorm2d in one process)."""

    def __init__(self, in_channels, n_output_channels, use_batchnorm=False, use_cls_token=True):
        super().__init__()
        self.channels = sum(in_channels) * (2 if use_cls_token else 1)
        self.use_cls_token = use_cls_token
        self.batchnorm_layer = nn.BatchNorm2d(self.channels) if use_batchnorm else nn.Identity(self.channels)
        self.conv_depth = nn.Conv2d(self.channels, n_output_channels, kernel_size=1, padding=0, stride=1)
        nn.init.normal_(self.conv_depth.weight, mean=0, std=0.01)
        nn.init.constant_(self.conv_depth.bias, 0)

    def forward(self, inputs):
        inputs = list(inputs)
        for i, x in enumerate(inputs):
            if self.use_cls_token:
                x, cls_token = x[0], x[1]
                cls_token = cls_token[:, :, None, None].expand_as(x)
                inputs[i] = torch.cat((x, cls_token), 1)
            else:
                inputs[i] = x[0]
        x = [
            F.interpolate(input=x, size=list(inputs[0].shape[2:]), mode="bilinear", align_corners=False) for x in inputs
        ]
        x = torch.cat(x, dim=1)
        return self.conv_depth(self.batchnorm_layer(x))


def ref_features_to_depth(x, min_depth, max_depth):
    """dinov3 models/__init__.py:75-110, bins_strategy linear, norm_strategy linear."""
    n_bins = x.shape[1]
    bins = torch.linspace(min_depth, max_depth, n_bins, device=x.device)
    logit = torch.relu(x)
    eps = 0.1
    logit = logit + eps
    logit = logit / logit.sum(dim=1, keepdim=True)
    return torch.einsum("ikmn,k->imn", [logit, bins]).unsqueeze(dim=1)


def ref_annealing_cos(start, end, pct):
    cos_out = math.cos(math.pi * pct) + 1
    return end + (start - end) / 2.0 * cos_out


class RefWarmupOneCycleLR(torch.optim.lr_scheduler.LRScheduler):
    """dinov3 schedulers.py:30-152 (cos; the torch-version warning call dropped)."""

    def __init__(self, optimizer, total_steps=0, warmup_iters=0, pct_start=0.295, max_lr=None, base_momentum=0.85,
                 max_momentum=0.95, div_factor=25.0, final_div_factor=1000.0, last_epoch=-1):  # fmt: skip
        self.warmup_iters = warmup_iters
        self.base_momentum = base_momentum
        self.max_momentum = max_momentum
        self.total_steps = total_steps
        self.final_div_factor = final_div_factor
        max_lr = [max_lr]
        for idx, group in enumerate(optimizer.param_groups):
            ml = max_lr[idx]
            group["initial_lr"] = ml / div_factor
            group["max_lr"] = ml
            group["min_lr"] = group["initial_lr"] / final_div_factor
            group["lr"] = ml / final_div_factor if self.warmup_iters > 0 else group["initial_lr"]
            group["betas"] = (self.max_momentum, *group["betas"][1:])
        super().__init__(optimizer, last_epoch)

    def _compute_lr_momentum(self, optimizer_param_group):
        step_num = (self._step_count - 1) if self.last_epoch != -1 else 0
        momentum = 0
        if step_num < self.warmup_iters:
            gmax = optimizer_param_group["max_lr"] * (1 + math.cos(math.pi * step_num / float(self.total_steps))) / 2
            thelr = optimizer_param_group["max_lr"] / self.final_div_factor + gmax * step_num / float(self.warmup_iters)
        else:
            pct = (step_num - self.warmup_iters) / float(self.total_steps - self.warmup_iters)
            step_num_to_use = step_num
            momentum = ref_annealing_cos(self.base_momentum, self.max_momentum, pct)
            step_num_to_use += 1
            thelr = ref_annealing_cos(
                optimizer_param_group["max_lr"],
                optimizer_param_group["min_lr"],
                step_num_to_use / float(self.total_steps),
            )
        return thelr, momentum

    def get_lr(self):
        lrs = []
        for group in self.optimizer.param_groups:
            computed_lr, computed_momentum = self._compute_lr_momentum(group)
            lrs.append(computed_lr)
            group["betas"] = (computed_momentum, *group["betas"][1:])
        return lrs


# ------------------------------------------------------------------ dinov2 ports
def ref_dinov2_bnhead(inputs, conv, min_depth, max_depth, upsample=4):
    """DINOv2 BNHead._forward_feature + _transform_inputs (resize_concat, in_index all, upsample)
    + DepthBaseDecodeHead.depth_pred (classify, UD, linear); ``conv`` the 1x1 conv_depth."""
    inputs = list(inputs)
    for i, x in enumerate(inputs):
        x, cls_token = x[0], x[1]
        cls_token = cls_token[:, :, None, None].expand_as(x)
        inputs[i] = torch.cat((x, cls_token), 1)
    size = [s * upsample for s in inputs[0].shape[2:]]
    inputs = [F.interpolate(input=x, size=size, mode="bilinear", align_corners=False) for x in inputs]
    logit = conv(torch.cat(inputs, dim=1))
    bins = torch.linspace(min_depth, max_depth, 256, device=logit.device)
    logit = torch.relu(logit)
    logit = logit + 0.1
    logit = logit / logit.sum(dim=1, keepdim=True)
    return torch.einsum("ikmn,k->imn", [logit, bins]).unsqueeze(dim=1)


def ref_dinov2_gradientloss(input, target):
    """DINOv2 losses/gradientloss.py:33-63 (valid_mask=True, max_depth None), as written."""
    eps = 0.001
    input_downscaled = [input] + [input[:: 2 * i, :: 2 * i] for i in range(1, 4)]
    target_downscaled = [target] + [target[:: 2 * i, :: 2 * i] for i in range(1, 4)]
    gradient_loss = 0
    for input, target in zip(input_downscaled, target_downscaled):
        mask = target > 0
        N = torch.sum(mask)
        log_d_diff = torch.log(input + eps) - torch.log(target + eps)
        log_d_diff = torch.mul(log_d_diff, mask)
        v_gradient = torch.abs(log_d_diff[0:-2, :] - log_d_diff[2:, :])
        v_mask = torch.mul(mask[0:-2, :], mask[2:, :])
        v_gradient = torch.mul(v_gradient, v_mask)
        h_gradient = torch.abs(log_d_diff[:, 0:-2] - log_d_diff[:, 2:])
        h_mask = torch.mul(mask[:, 0:-2], mask[:, 2:])
        h_gradient = torch.mul(h_gradient, h_mask)
        gradient_loss += (torch.sum(h_gradient) + torch.sum(v_gradient)) / N
    return gradient_loss


def ref_dinov2_sigloss(input, target, warm_up, counter, warm_iter=100):
    """DINOv2 losses/sigloss.py:42-59 (valid_mask=True): returns (loss, counter)."""
    eps = 0.001
    valid_mask = target > 0
    input = input[valid_mask]
    target = target[valid_mask]
    if warm_up and counter < warm_iter:
        g = torch.log(input + eps) - torch.log(target + eps)
        g = 0.15 * torch.pow(torch.mean(g), 2)
        return torch.sqrt(g), counter + 1
    g = torch.log(input + eps) - torch.log(target + eps)
    Dg = torch.var(g) + 0.15 * torch.pow(torch.mean(g), 2)
    return torch.sqrt(Dg), counter


def ref_dinov2_linear_head_kwargs(layers, pretrained=True, weights="NYU"):
    """DINOv2 hub/depthers.py:22-33 + 36-67 + 87-89: the depth range it computes and the range
    the linear head is built with (``min_depth``/``max_depth`` are accepted, then fixed)."""

    def _get_depth_range(pretrained, weights):
        if not pretrained:
            return (0.001, 10.0)
        if weights == "KITTI":
            return (0.001, 80.0)
        if weights == "NYU":
            return (0.001, 10.0)
        return (0.001, 10.0)

    depth_range = _get_depth_range(pretrained, weights)
    # depthers.py:89 unpacks it into min_depth, max_depth and passes them to the head's builder,
    # which accepts them (depthers.py:40-41) and builds the head with 0.001 and 80 (:64-65)
    head = {"n_bins": 256, "upsample": 4, "min_depth": 0.001, "max_depth": 80, "in_index": list(range(layers))}
    return depth_range, head


# ------------------------------------------------------------------ data
def _depth_pair(seed: int, shape=(3, 1, 24, 30)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positive predictions near a piecewise-planar target with holes (0 = no reading)."""
    g = torch.Generator().manual_seed(seed)
    target = 1.0 + 6.0 * torch.rand(shape, generator=g)
    target[..., : shape[-2] // 2, :] = 2.5  # a plane
    target[torch.rand(shape, generator=g) < 0.1] = 0.0
    pred = (target.clamp(min=0.5) * (1 + 0.2 * torch.randn(shape, generator=g))).clamp(min=0.05)
    return pred, target, target > 0


# ------------------------------------------------------------------ tests
def test_sigloss_matches_dinov3_and_dinov2_through_the_warm_up(threads: int) -> None:
    ours, ref = SigLoss(warm_up=True, warm_iter=3), RefSigLoss(warm_up=True, warm_iter=3)
    counter = 0
    for step in range(6):
        pred, target, valid = _depth_pair(step)
        a, b = ours(pred, target, valid), ref(pred, target, valid)
        c, counter = ref_dinov2_sigloss(pred, target, True, counter, warm_iter=3)
        assert float(a) == pytest.approx(float(b), rel=1e-6, abs=1e-7)
        assert float(a) == pytest.approx(float(c), rel=1e-6, abs=1e-7)
    assert ours.counter == ref.warm_up_counter == 3
    assert float(SigLoss(warm_up=False)(pred, target, valid)) > float(SigLoss()(pred, target, valid))


def test_sigloss_gradient_matches_dinov3(threads: int) -> None:
    pred, target, valid = _depth_pair(7)
    p1, p2 = pred.clone().requires_grad_(True), pred.clone().requires_grad_(True)
    SigLoss(warm_up=False)(p1, target, valid).backward()
    RefSigLoss(warm_up=False)(p2, target, valid).backward()
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-9)


def test_gradient_loss_matches_dinov3_on_batches_and_dinov2_per_image(threads: int) -> None:
    pred, target, valid = _depth_pair(3)
    ours = gradient_log_loss(pred, target, valid)
    torch.testing.assert_close(ours, RefGradientLogLoss()(pred, target, valid.float()), rtol=1e-5, atol=1e-7)
    # one image [H, W]: DINOv2's GradientLoss (its mask: target > 0) is the same number
    for i in range(pred.shape[0]):
        p, t = pred[i, 0], target[i, 0]
        torch.testing.assert_close(gradient_log_loss(p, t, t > 0), ref_dinov2_gradientloss(p, t), rtol=1e-5, atol=1e-7)
    assert float(ours) > 0


def test_dinov2_gradient_loss_quirk_on_its_4d_predictions() -> None:
    """DINOv2 slices the leading axes: on its [B, 1, H, W] maps with 2 images per GPU (bs 2) the
    loss is exactly 0 (nothing is differenced); featcache differences the spatial axes."""
    pred, target, valid = _depth_pair(5, shape=(2, 1, 24, 30))
    assert float(ref_dinov2_gradientloss(pred, target)) == 0.0
    assert float(gradient_log_loss(pred, target, valid)) > 0.0


def test_warmup_one_cycle_matches_dinov3_every_step() -> None:
    total, warm, lr = 90, 30, 3e-4
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p], "lr": lr, "betas": (0.9, 0.99), "weight_decay": 1e-4}])
    sched = RefWarmupOneCycleLR(opt, total_steps=total, warmup_iters=warm, max_lr=lr, final_div_factor=1000.0)
    for step in range(total):
        group = opt.param_groups[0]
        ours_lr, ours_beta1 = warmup_one_cycle(step, total, warm, lr, final_div_factor=1000.0)
        assert ours_lr == pytest.approx(group["lr"], rel=1e-12, abs=0), step
        assert ours_beta1 == pytest.approx(group["betas"][0], rel=1e-12, abs=0), step
        opt.step()
        sched.step()
    assert warmup_one_cycle(0, total, warm, lr)[1] == 0.0  # the reference's beta1 during warm-up
    assert warmup_one_cycle(total - 1, total, warm, lr)[0] == pytest.approx(lr / 25 / 1000, rel=1e-9)


def test_bins_to_depth_matches_features_to_depth(threads: int) -> None:
    x = torch.randn(2, 256, 5, 6, generator=torch.Generator().manual_seed(0))
    for lo, hi in ((1e-3, 10.0), (1e-3, 80.0)):
        torch.testing.assert_close(bins_to_depth(x, lo, hi), ref_features_to_depth(x, lo, hi), rtol=1e-6, atol=1e-6)


def _tokens(seed: int, b=3, d=8, gh=4, gw=5, blocks=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, gh, gw, generator=g) for _ in range(blocks)], [
        torch.randn(b, d, generator=g) for _ in range(blocks)
    ]


def test_dinov3_head_matches_linear_head_and_features_to_depth(threads: int) -> None:
    patches, _ = _tokens(1)
    torch.manual_seed(0)
    ours = DepthLinearHead(8, 1, use_cls=False, batchnorm=True, upsample=1, max_depth=10.0, init_std=0.01)
    torch.manual_seed(0)
    ref = RefLinearHead([8], 256, use_batchnorm=True, use_cls_token=False)
    torch.testing.assert_close(ours.conv.weight, ref.conv_depth.weight)  # the same init draw
    for mode in ("train", "eval"):
        getattr(ours, mode)(), getattr(ref, mode)()
        want = ref_features_to_depth(ref([(patches[0], None)]), 1e-3, 10.0)
        torch.testing.assert_close(ours(patches), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [1, 4])
def test_dinov2_head_matches_bnhead_upsampling_before_the_conv(threads: int, blocks: int) -> None:
    patches, cls = _tokens(2, blocks=blocks)
    ours = DepthLinearHead(8, blocks, use_cls=True, batchnorm=False, upsample=4, max_depth=80.0, init_std=None)
    want = ref_dinov2_bnhead(list(zip(patches, cls)), ours.conv, 1e-3, 80.0)
    got = ours(patches, cls)
    assert got.shape == (3, 1, 16, 20)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dinov2_hub_linear_head_fixes_80m_whatever_the_weights() -> None:
    """The quirk: the NYU weights' depth range is 10 m, yet the linear head's bins span 80 m.
    featcache's ``dinov2-lin*`` bins span the dataset's range (NYU: 10 m) unless the grid's
    ``max_depth`` says 80, which then reproduces the hub's head."""
    for layers in (1, 4):
        depth_range, head = ref_dinov2_linear_head_kwargs(layers, weights="NYU")
        assert depth_range == (0.001, 10.0)
        assert head["max_depth"] == 80
    patches, cls = _tokens(4)
    ours80 = DepthLinearHead(8, 1, use_cls=True, batchnorm=False, upsample=4, max_depth=80.0, init_std=None)
    ours10 = DepthLinearHead(8, 1, use_cls=True, batchnorm=False, upsample=4, max_depth=10.0, init_std=None)
    ours10.load_state_dict(ours80.state_dict())
    hub = ref_dinov2_bnhead(list(zip(patches, cls)), ours80.conv, head["min_depth"], head["max_depth"])
    torch.testing.assert_close(ours80(patches, cls), hub, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours10(patches, cls), hub)


def test_flip_averaging_and_evaluation_order_match_dinov3(threads: int) -> None:
    """A batch [x; hflip(x)] through the head and LeftRightFlipAug.inverse (dinov3
    transforms.py:153-161), resized to the ground truth, then eval.py's range / Eigen crop /
    clamp and calculate_depth_metrics per image, vs featcache's predict_depth + DepthAccumulator."""
    from featcache.dense.depth import _resize

    patches, _ = _tokens(5, gh=6, gw=8)
    flipped = [torch.flip(p, dims=[-1]) for p in patches]
    head = DepthLinearHead(8, 1, use_cls=False, batchnorm=True, max_depth=10.0).eval()
    with torch.no_grad():
        both = head([torch.cat([patches[0], flipped[0]])])
        b = both.shape[0] // 2
        ref = (both[:b] + torch.flip(both[b:], dims=[-1])) / 2  # TF.hflip is a flip of the last axis
        ours = (head(patches) + torch.flip(head(flipped), dims=[-1])) / 2
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    gt = 0.5 + 9.0 * torch.rand(3, 1, 48, 64, generator=torch.Generator().manual_seed(9))
    gt[..., :5, :] = 0.0
    acc = DepthAccumulator(min_depth=1e-3, max_depth=10.0, eigen_crop=True)
    up = _resize(ours, (48, 64))
    for i in range(3):
        acc.update(gt[i, 0].numpy().astype(np.float64), up[i, 0].numpy().astype(np.float64))
    want = _ref_eval(gt, F.interpolate(ref, size=(48, 64), mode="bilinear", align_corners=False))
    got = acc.compute()
    for k in ("rmse", "abs_rel", "delta1"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7)


def _ref_eval(gt: torch.Tensor, preds: torch.Tensor) -> dict[str, float]:
    """dinov3 eval.py:138-186 with make_valid_mask (datasets_utils.py:16-42, NYU_EIGEN) and
    calculate_depth_metrics' rmse / abs_rel / a1 (metrics.py), per image, nanmean over images."""
    out: dict[str, list[float]] = {"rmse": [], "abs_rel": [], "delta1": []}
    for i in range(gt.shape[0]):
        g, p = gt[i : i + 1], preds[i : i + 1]
        g = torch.where(torch.logical_or(g >= 10.0, g <= 1e-3), 0.0, g)
        _, _, h, w = g.shape
        mask = torch.zeros(g.shape)
        mask[:, :, int((45 / 480) * h) : int((471 / 480) * h), int((41 / 640) * w) : int((601 / 640) * w)] = 1
        ign = torch.ones((1, 1, h, w))
        ign[(g == 0).all(dim=1, keepdim=True)] = 0
        valid = torch.logical_and((mask * ign).bool(), g > 0)  # + calculate_depth_metrics:55
        p = p.clamp(min=1e-3, max=10.0)
        gv, pv = g[valid].double(), p[valid].double()
        thresh = torch.maximum(gv / pv, pv / gv)
        out["rmse"].append(float(torch.sqrt(((gv - pv) ** 2).mean())))
        out["abs_rel"].append(float(torch.mean(torch.abs(gv - pv) / gv)))
        out["delta1"].append(float((thresh < 1.25).double().mean()))
    return {k: float(np.nanmean(v)) for k, v in out.items()}
