"""featcache.core.dense_metrics vs ports of the reference code (torch, 1 and 2 threads), brute
force (scikit-learn's confusion matrix; every permutation for the Hungarian matching) and
Hypothesis invariants, on label maps made from Fashion-MNIST garments and depth maps made from
scikit-image photographs."""

from __future__ import annotations

import gzip
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import confusion_matrix

from featcache.core.dense_metrics import (
    DENSE_LOWER_IS_BETTER,
    DepthAccumulator,
    HummingbirdAccumulator,
    SegmentationAccumulator,
    depth_image_metrics,
    depth_metrics,
    eigen_crop_mask,
    hbird_miou,
    reduce_zero_label,
    seg_metrics,
)
from featcache.errors import MetricInputError

FMNIST = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
FMNIST_LABELS = Path("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")


# ---------------------------------------------------------------------------- reference ports
# facebookresearch/dinov3 @ 6876159a11b4df116f30f667f8c9888617df0751,
# dinov3/eval/segmentation/metrics.py:68-73 (preprocess_nonzero_labels)
def ref_preprocess_nonzero_labels(label, ignore_index=255):
    label_new = label.clone()
    label_new[label_new == ignore_index] += 1
    label_new -= 1
    label_new[label_new == -1] = ignore_index
    return label_new


# dinov3/eval/segmentation/metrics.py:76-98 (calculate_intersect_and_union)
def ref_intersect_and_union(pred_label, label, num_classes, ignore_index=255, reduce_zero_label=False):
    pred_label = pred_label.float()
    if reduce_zero_label:
        label = ref_preprocess_nonzero_labels(label, ignore_index=ignore_index)
    mask = label != ignore_index
    pred_label = pred_label[mask]
    label = label[mask]
    intersect = pred_label[pred_label == label]
    area_intersect = torch.histc(intersect.float(), bins=(num_classes), min=0, max=num_classes - 1)
    area_pred_label = torch.histc(pred_label.float(), bins=(num_classes), min=0, max=num_classes - 1)
    area_label = torch.histc(label.float(), bins=(num_classes), min=0, max=num_classes - 1)
    area_union = area_pred_label + area_label - area_intersect
    return torch.stack([area_intersect, area_union, area_pred_label, area_label])


# dinov3/eval/segmentation/metrics.py:20-65 + 137-142 (calculate_segmentation_metrics with
# total_area_to_metrics' aAcc / mIoU / acc; the per-class pandas log left out)
def ref_segmentation_metrics(pre_eval_results):
    pre_eval_results = tuple(zip(*pre_eval_results))
    assert len(pre_eval_results) == 4
    total_area_intersect = sum(pre_eval_results[0])
    total_area_union = sum(pre_eval_results[1])
    total_area_label = sum(pre_eval_results[3])
    all_acc = total_area_intersect.sum() / total_area_label.sum()
    iou = total_area_intersect / total_area_union
    acc = total_area_intersect / total_area_label
    return {"miou": float(iou.nanmean()), "macc": float(acc.nanmean()), "aacc": float(all_acc.nanmean())}


# dinov3/eval/depth/datasets/datasets_utils.py:16-42 (make_valid_mask, NYU_EIGEN)
def ref_make_valid_mask(input, eigen=True, ignored_value=0.0):
    B, _, h, w = input.shape
    eval_mask = torch.zeros(input.shape, device=input.device)
    if eigen:
        y1, y2, x1, x2 = 45, 471, 41, 601
        orig_h, orig_w = 480, 640
        y1_new = int((y1 / orig_h) * h)
        y2_new = int((y2 / orig_h) * h)
        x1_new = int((x1 / orig_w) * w)
        x2_new = int((x2 / orig_w) * w)
        eval_mask[:, :, y1_new:y2_new, x1_new:x2_new] = 1
    else:
        eval_mask.fill_(1)
    ignored_value_mask = torch.ones((B, 1, h, w), device=eval_mask.device)
    ignored_value_mask[(input == ignored_value).all(dim=1, keepdims=True)] = 0
    eval_mask = eval_mask * ignored_value_mask
    return eval_mask.bool()


# dinov3/eval/depth/metrics.py:45-91 (calculate_depth_metrics, every metric)
def ref_calculate_depth_metrics(gt, pred, valid_mask):
    if gt.shape[0] == 0:
        return [torch.nan] * 10
    if valid_mask is not None:
        valid_mask = torch.logical_and(valid_mask, gt > 0)
    gt = gt[valid_mask]
    pred = pred[valid_mask]
    m = {}
    thresh = torch.maximum((gt / pred), (pred / gt))
    m["delta1"] = (thresh < 1.25).float().mean()
    m["delta2"] = (thresh < 1.25**2).float().mean()
    m["delta3"] = (thresh < 1.25**3).float().mean()
    error = gt - pred
    sq_error = error**2
    m["mae"] = torch.mean(torch.abs(error))
    m["abs_rel"] = torch.mean(torch.abs(error) / gt)
    m["sq_rel"] = torch.mean(sq_error / gt)
    m["rmse"] = torch.sqrt(sq_error.mean())
    error_log = torch.log(gt) - torch.log(pred)
    sq_error_log = error_log**2
    m["rmse_log"] = torch.sqrt(sq_error_log.mean())
    silog = torch.sqrt(torch.mean(sq_error_log) - torch.mean(error_log) ** 2) * 100
    if torch.isnan(silog):
        silog = torch.tensor(0)
    m["silog"] = silog
    m["log10"] = (torch.abs(torch.log10(gt) - torch.log10(pred))).mean()
    return m


# dinov3/eval/depth/eval.py:120-201 (the per-image loop body after the prediction is at the
# gt's size: range -> ignored value, valid mask, clamp, metrics; then nanmean over images)
def ref_depth_eval(gts, preds, eval_range=(0.001, 10.0), ignored_value=0.0, eigen=True):
    values: dict[str, list] = {}
    for gt_map, pred in zip(gts, preds, strict=True):
        gt_map = torch.from_numpy(np.asarray(gt_map, np.float32))[None, None]
        preds_t = torch.from_numpy(np.asarray(pred, np.float32))[None, None]
        gt_map = torch.where(torch.logical_or(gt_map >= eval_range[1], gt_map <= eval_range[0]), ignored_value, gt_map)
        valid_mask = ref_make_valid_mask(gt_map, eigen=eigen, ignored_value=ignored_value)
        preds_t = preds_t.clamp(min=eval_range[0], max=eval_range[1])
        for k, v in ref_calculate_depth_metrics(gt_map, preds_t, valid_mask).items():
            values.setdefault(k, []).append(v)
    return {k: float(torch.tensor(v).nanmean()) for k, v in values.items()}


# vpariza/open-hummingbird-eval @ 5e79da292730edded800a89828b84f38469f5476,
# hbird/utils/eval_metrics.py:73-109 (update), 112-131 (_score_matrix), 143-159
# (_hungarian_mapping), 191-209 (_tp_fp_fn_from_mapping), 212-218 (_miou_from_counts)
def ref_hbird_miou(gt, pred, num_classes, ignore_index=255, num_pred=None):
    G, P = num_classes, num_pred or num_classes
    conf = torch.zeros((G, P), dtype=torch.int64)
    gt = torch.from_numpy(np.asarray(gt)).reshape(-1).long()
    pred = torch.from_numpy(np.asarray(pred)).reshape(-1).long()
    mask = gt.ne(ignore_index)
    gt, pred = gt[mask], pred[mask]
    valid = (gt >= 0) & (gt < G) & (pred >= 0) & (pred < P)
    if not torch.all(valid):
        gt, pred = gt[valid], pred[valid]
    conf += torch.bincount(gt * P + pred, minlength=G * P).view(G, P)
    C = conf.to(torch.float64)
    denom = C.sum(dim=1, keepdim=True) + C.sum(dim=0, keepdim=True) - C
    score = C / torch.clamp(denom, min=1e-8)
    row_ind, col_ind = linear_sum_assignment(1.0 - score.numpy())
    mapping = torch.zeros(P, dtype=torch.int64)
    for r, c in zip(row_ind, col_ind, strict=True):
        mapping[c] = int(r)
    C_mapped = torch.zeros((G, G), dtype=conf.dtype)
    C_mapped.index_add_(1, mapping, conf)
    tp_t = torch.diag(C_mapped)
    fp_t = C_mapped.sum(dim=0) - tp_t
    fn_t = conf.sum(dim=1) - tp_t
    tp, fp, fn = (t.to(torch.float64) for t in (tp_t, fp_t, fn_t))
    return float((tp / torch.clamp(tp + fp + fn, min=1e-8)).mean())


# ---------------------------------------------------------------------------- data
def _fmnist(n: int) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(FMNIST) as f:
        raw = f.read(16 + n * 784)
    with gzip.open(FMNIST_LABELS) as f:
        y = np.frombuffer(f.read(8 + n), np.uint8)[8:]
    return np.frombuffer(raw, np.uint8)[16:].reshape(n, 28, 28), y


@pytest.fixture(scope="module")
def seg_split():
    """Label maps: garment pixels (intensity > 40) get their class + 1, background 0, a border
    of ignore (255); only garments 0-5 kept so classes 7-10 are absent. Predictions: the maps
    shifted one pixel, 10% of pixels noised to random ids (some out of the label's classes),
    class 3 read as 4."""
    imgs, y = _fmnist(200)
    keep = np.flatnonzero(y < 6)[:64]
    labels = np.where(imgs[keep] > 40, y[keep, None, None] + 1, 0).astype(np.uint8)
    labels[:, 0, :] = 255
    rng = np.random.default_rng(0)
    pred = np.roll(labels, 1, axis=2).astype(np.int64)
    pred[pred == 255] = 0
    noise = rng.random(pred.shape) < 0.1
    pred[noise] = rng.integers(0, 9, noise.sum())
    pred[pred == 3] = 4
    return labels, pred


@pytest.fixture(scope="module")
def depth_split():
    """Depth maps from scikit-image photographs (intensity scaled to 0-12 m, so some pixels fall
    outside (0.001, 10) m and some are 0), one at NYU's 480 x 640; predictions = the maps blurred,
    scaled by 1.1 and noised (some negative, clamped by the protocol)."""
    from scipy.ndimage import uniform_filter
    from skimage import data
    from skimage.color import rgb2gray
    from skimage.transform import resize

    photos = [data.camera(), data.coins(), rgb2gray(data.chelsea()), resize(data.moon(), (480, 640))]
    rng = np.random.default_rng(1)
    gts, preds = [], []
    for ph in photos:
        g = (np.asarray(ph, np.float64) / max(float(np.max(ph)), 1e-9) * 12.0).astype(np.float32)
        p = uniform_filter(g, 5) * 1.1 + rng.normal(0, 0.3, g.shape)
        gts.append(g)
        preds.append(p.astype(np.float32))
    return gts, preds


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- segmentation
@pytest.mark.parametrize("rzl", [False, True], ids=["plain", "reduce_zero_label"])
def test_seg_metrics_equal_dinov3(seg_split, threads, rzl):
    labels, pred = seg_split
    k = 11
    pre = [
        ref_intersect_and_union(torch.from_numpy(p), torch.from_numpy(lab.astype(np.int64)), k, reduce_zero_label=rzl)
        for lab, p in zip(labels, pred, strict=True)
    ]
    ref = ref_segmentation_metrics(pre)
    acc = SegmentationAccumulator(k, reduce_zero_label=rzl)
    for i in range(0, len(labels), 16):  # streamed in batches
        acc.update(labels[i : i + 16], pred[i : i + 16])
    got = acc.compute()
    assert got == pytest.approx(ref, rel=1e-6)
    assert seg_metrics(labels, pred, k, reduce_zero_label=rzl) == got
    ref_areas = torch.stack(pre).sum(0).numpy()
    np.testing.assert_array_equal(ref_areas, np.stack([acc.intersect, acc.union, acc.pred_area, acc.label_area]))


def test_seg_metrics_equal_a_confusion_matrix(seg_split):
    labels, pred = seg_split
    k = 11
    valid = labels != 255
    cm = confusion_matrix(labels[valid], pred[valid], labels=range(k)).astype(float)
    tp = np.diag(cm)
    with np.errstate(invalid="ignore"):
        iou = tp / (cm.sum(0) + cm.sum(1) - tp)
        acc = tp / cm.sum(1)
    got = seg_metrics(labels, pred, k)
    # 9, 10 absent from both (left out of mIoU); 7, 8 only predicted (IoU 0, left out of mAcc);
    # 3 only in the labels (IoU 0, acc 0)
    assert np.flatnonzero(np.isnan(iou)).tolist() == [9, 10]
    assert np.flatnonzero(np.isnan(acc)).tolist() == [7, 8, 9, 10]
    assert iou[[3, 7, 8]].tolist() == [0.0, 0.0, 0.0]
    assert acc[3] == 0.0
    assert got["miou"] == pytest.approx(np.nanmean(iou), rel=1e-12)
    assert got["macc"] == pytest.approx(np.nanmean(acc), rel=1e-12)
    assert got["aacc"] == pytest.approx(tp.sum() / cm.sum(), rel=1e-12)
    rz = reduce_zero_label(labels)
    assert set(np.unique(rz)) == {0, 1, 2, 3, 4, 5, 255}
    assert (rz[labels == 0] == 255).all()


def test_seg_out_of_range_ids_drop_from_their_own_area():
    """As torch.histc does: a predicted id >= K counts in no area, but its pixel's label still does."""
    acc = SegmentationAccumulator(3)
    acc.update(np.array([[0, 1, 2, 2]]), np.array([[0, 1, 7, 2]]))
    assert acc.label_area.tolist() == [1, 1, 2]
    assert acc.pred_area.tolist() == [1, 1, 1]
    assert acc.compute() == {"miou": pytest.approx((1 + 1 + 0.5) / 3), "macc": pytest.approx(2.5 / 3), "aacc": 0.75}


def test_seg_inputs_refused():
    with pytest.raises(MetricInputError, match="resize the prediction"):
        seg_metrics(np.zeros((2, 3), int), np.zeros((3, 2), int), 2)
    with pytest.raises(MetricInputError, match="argmax"):
        seg_metrics(np.zeros((2, 3), int), np.zeros((2, 3)), 2)
    assert math.isnan(seg_metrics(np.full((2, 2), 255), np.zeros((2, 2), int), 2)["miou"])


# ---------------------------------------------------------------------------- depth
@pytest.mark.parametrize("eigen", [True, False], ids=["eigen", "full"])
def test_depth_metrics_equal_dinov3(depth_split, threads, eigen):
    gts, preds = depth_split
    ref = ref_depth_eval(gts, preds, eigen=eigen)
    got = depth_metrics(gts, preds, eigen_crop=eigen)
    assert set(got) == set(ref)
    for name in got:  # the reference computes in float32
        assert got[name] == pytest.approx(ref[name], rel=2e-5, abs=1e-6), name


def test_depth_averages_images_and_matches_a_direct_eigen_crop(depth_split):
    gts, preds = depth_split
    g, p = gts[3].astype(np.float64), preds[3].astype(np.float64)
    assert g.shape == (480, 640)
    mask = np.zeros_like(g, bool)
    mask[45:471, 41:601] = True
    np.testing.assert_array_equal(eigen_crop_mask(g.shape), mask)
    valid = mask & (g > 1e-3) & (g < 10.0)
    gv, pv = g[valid], np.clip(p[valid], 1e-3, 10.0)
    one = depth_image_metrics(g, p)
    assert one["rmse"] == pytest.approx(np.sqrt(np.mean((gv - pv) ** 2)), rel=1e-12)
    assert one["abs_rel"] == pytest.approx(np.mean(np.abs(gv - pv) / gv), rel=1e-12)
    assert one["delta1"] == pytest.approx(np.mean(np.maximum(gv / pv, pv / gv) < 1.25), rel=1e-12)
    per_image = [depth_image_metrics(a, b) for a, b in zip(gts, preds, strict=True)]
    acc = DepthAccumulator()
    acc.update(np.stack(gts[3:]), np.stack(preds[3:]))  # a (b, h, w) batch
    for a, b in zip(gts[:3], preds[:3], strict=True):
        acc.update(a, b)
    assert acc.n_images == 4
    for name, v in acc.compute().items():
        assert v == pytest.approx(np.mean([m[name] for m in per_image]), rel=1e-12), name


def test_depth_image_without_valid_pixel_is_left_out():
    g = np.full((8, 8), 20.0)  # all beyond max_depth
    assert math.isnan(depth_image_metrics(g, g)["rmse"])
    good = np.linspace(1, 5, 64).reshape(8, 8)
    got = depth_metrics([g, good], [g, good * 1.5], eigen_crop=False)
    assert got == depth_image_metrics(good, good * 1.5, eigen_crop=False)
    with pytest.raises(MetricInputError, match="bilinear"):
        depth_image_metrics(np.ones((4, 4)), np.ones((2, 2)))
    assert "rmse" in DENSE_LOWER_IS_BETTER
    assert "delta1" not in DENSE_LOWER_IS_BETTER


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_depth_perfect_prediction(seed, eigen):
    g = np.random.default_rng(seed).uniform(0.01, 9.9, (48, 64))
    got = depth_image_metrics(g, g, eigen_crop=eigen)
    assert got["delta1"] == got["delta2"] == got["delta3"] == 1.0
    for name in DENSE_LOWER_IS_BETTER:
        assert got[name] == pytest.approx(0.0, abs=1e-6), name


# ---------------------------------------------------------------------------- hummingbird
def _cluster_map(pred: np.ndarray, perm: np.ndarray) -> np.ndarray:
    return perm[pred]


def test_hbird_miou_equals_open_hummingbird_eval(seg_split, threads):
    labels, pred = seg_split
    perm = np.random.default_rng(2).permutation(11)
    clusters = _cluster_map(pred, perm)  # cluster ids need not be class ids
    ref = ref_hbird_miou(labels, clusters, 11)
    assert hbird_miou(labels, clusters, 11) == pytest.approx(ref, rel=1e-12)
    acc = HummingbirdAccumulator(11)
    for i in range(0, len(labels), 16):
        acc.update(labels[i : i + 16], clusters[i : i + 16])
    assert acc.compute() == pytest.approx(ref, rel=1e-12)
    # more cluster ids (14) than classes (7 present): the unmatched fold into class 0, as upstream does
    half = (pred == 4) & (np.indices(pred.shape).sum(0) % 2 == 0)  # class 4's cluster split in two
    over = np.where(half, 13, clusters)
    assert hbird_miou(labels, over, 7, num_pred_classes=14) == pytest.approx(
        ref_hbird_miou(labels, over, 7, num_pred=14)
    )
    # absent classes count 0: a different number from seg mIoU's nanmean
    assert acc.compute() < seg_metrics(labels, pred, 11)["miou"]


def test_hbird_miou_is_the_best_of_every_matching(seg_split):
    """Brute force: every bijection of 6 cluster ids onto 6 classes, IoU from sklearn's matrix."""
    labels, pred = seg_split
    lab = labels[:, 1:].astype(np.int64).ravel()  # the ignore border left out
    prd = np.minimum(pred[:, 1:].ravel(), 5)
    lab = np.minimum(lab, 5)
    cm = confusion_matrix(lab, prd, labels=range(6)).astype(float)
    best = 0.0
    for perm in itertools.permutations(range(6)):
        iou = [cm[perm[c], c] / (cm[perm[c]].sum() + cm[:, c].sum() - cm[perm[c], c]) for c in range(6)]
        best = max(best, float(np.mean(iou)))
    assert hbird_miou(lab, prd, 6) == pytest.approx(best, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 7))
def test_hbird_invariant_to_relabelling_and_perfect_counts_present_classes(seed, k):
    rng = np.random.default_rng(seed)
    lab = rng.integers(0, k, (3, 9, 9))
    lab[rng.random(lab.shape) < 0.05] = 255
    prd = np.where(rng.random(lab.shape) < 0.7, np.where(lab == 255, 0, lab), rng.integers(0, k, lab.shape))
    base = hbird_miou(lab, prd, k)
    pt, pp = rng.permutation(k), rng.permutation(k)
    lab_p = np.where(lab == 255, 255, pt[np.minimum(lab, k - 1)])
    assert hbird_miou(lab_p, pp[prd], k) == pytest.approx(base, abs=1e-12)
    present = np.unique(lab[lab != 255]).size
    assert hbird_miou(lab, np.where(lab == 255, 0, lab), k) == pytest.approx(present / k)
    assert seg_metrics(lab, np.where(lab == 255, 0, lab), k) == {"miou": 1.0, "macc": 1.0, "aacc": 1.0}
