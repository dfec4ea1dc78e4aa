"""Ported from microsoft/vision-evaluation, vision_evaluation/evaluators.py: the 11-point mAP of
``MeanAveragePrecisionNPointsEvaluator(11)``, which Computer-Vision-in-the-Wild/Elevater_Toolkit_IC
vision_benchmark/evaluation/metric.py ``map_11_points`` calls (VOC 2007's ``11point_mAP``)."""

from __future__ import annotations

import numpy as np
import sklearn.metrics as sm


def _calc_precision_recall_interp(predictions, targets, recall_thresholds):
    """PrecisionRecallCurveMixin._calc_precision_recall_interp."""
    precision, recall, _ = sm.precision_recall_curve(targets, predictions)
    precision_interp = np.empty(len(recall_thresholds))
    recall_idx = 0
    precision_tmp = 0
    for idx, threshold in enumerate(recall_thresholds):
        while recall_idx < len(recall) and threshold <= recall[recall_idx]:
            precision_tmp = max(precision_tmp, precision[recall_idx])
            recall_idx += 1
        precision_interp[idx] = precision_tmp
    return precision_interp


def elevater_map_11_points(targets, predictions, n_points=11):
    """MeanAveragePrecisionNPointsEvaluator(11)._calculate."""
    n_class = predictions.shape[1]
    recall_thresholds = np.linspace(1, 0, n_points, endpoint=True).tolist()
    return np.mean(
        [
            np.mean(_calc_precision_recall_interp(predictions[:, i], targets[:, i], recall_thresholds))
            for i in range(n_class)
        ]
    )
