"""A port of ELEVATER's linear probe on cached features, as its toolkit's code runs it.

Ported from Computer-Vision-in-the-Wild/Elevater_Toolkit_IC at commit
00d0af78559d5f3d800ae4668210e6bd1f2f84b9: vision_benchmark/evaluation/full_model_finetune.py
(``Classifier``, ``hyperparameter_sweep``, ``clone_loader``, ``train_task``, ``train_one``,
``validate``, ``adjust_learning_rate``, ``hyperparameter_sweep_lr``, ``merge_trainval_loader``,
``full_model_finetune``), vision_benchmark/evaluation/feature.py (``create_dataloader``,
``FeatureData``), vision_benchmark/optim/build.py (``_set_wd``/``build_optimizer``, the SGD
branch), vision_benchmark/evaluation/metric.py (``accuracy``, ``balanced_accuracy_score``,
``map_11_points``) and the vision-evaluation version its requirements.txt pins (0.2.9,
microsoft/vision-evaluation tag 0.2.9 = 0f34dcbc7ebd037357698808d056f0dba442f03e:
vision_evaluation/evaluators.py ``MemorizingEverythingEvaluator.calculate_score``,
``TopKAccuracyEvaluator``, ``BalancedAccuracyScoreEvaluator``,
``MeanAveragePrecisionNPointsEvaluator``; prediction_filters.py ``TopKPredictionFilter``).

The statements are the toolkit's; what had to change to run on cached features on a CPU is
marked ``# port:``: the backbone is the identity (the features are its output; with it
``get_model`` makes no random draw), ``.cuda()`` calls and cudnn flags are dropped, ``config``
is a namespace, the language-initialised head takes the text matrix directly. The random
stream is the toolkit's, draw for draw (issue 49): :func:`fix_seed` seeds torch once, as
vision_benchmark/commands/linear_probe.py:62-66 does before anything else, and nothing
reseeds it; each trial's ``Classifier`` (full_model_finetune.py:232) draws its ``nn.Linear``
(:104) from that running stream, and each ``validate`` pass (:270) draws one int64 base seed
from it by iterating its unshuffled loader (feature.py:96 gives such a loader
``generator=None``; torch's ``_BaseDataLoaderIter.__init__`` then draws from the global
generator). The shuffled train loaders draw from their own generator, seeded 0 afresh by
every ``create_dataloader`` (feature.py:84-85), so every trial sees the same batches.
Clipped neighbours of the weight-decay search are trained again (full_model_finetune.py:185-204),
each time from the stream's next draws. :func:`run_seeded` runs a port entry point so
seeded, leaving the caller's global generator as it was. ``train_task`` also records each
epoch's validation score in ``model_info['acc1_per_epoch']``, and the sweeps each trial's
(lr, wd, score) in :data:`TRIALS` (port: for tests).
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import sklearn.metrics as sm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

MULTILABEL_DATASETS = {"voc-2007-classification", "chestx-ray8"}


# ------------------------------------------------------------- vision-evaluation 0.2.9
def _targets_to_mat(targets, n_class):
    if len(targets.shape) == 1:
        target_mat = np.zeros((len(targets), n_class), dtype=int)
        for i, t in enumerate(targets):
            target_mat[i, t] = 1
    else:
        target_mat = targets

    return target_mat


class TopKPredictionFilter:
    def __init__(self, k: int):
        assert k >= 0
        self.k = k

    def filter(self, predictions, return_mode):
        k = min(predictions.shape[1], self.k)
        if k == 0:
            top_k_pred_indices = np.array([[] for i in range(predictions.shape[1])], dtype=int)
        elif k == 1:
            top_k_pred_indices = np.argmax(predictions, axis=1)
            top_k_pred_indices = top_k_pred_indices.reshape((-1, 1))
        else:
            top_k_pred_indices = np.argpartition(predictions, -k, axis=1)[:, -k:]

        if return_mode == "indices":
            return list(top_k_pred_indices)
        else:
            preds = np.zeros_like(predictions, dtype=bool)
            row_index = np.repeat(range(len(predictions)), k)
            col_index = top_k_pred_indices.reshape((1, -1))
            preds[row_index, col_index] = True

            return preds

    @property
    def identifier(self):
        return f"top{self.k}"


class TopKAccuracyEvaluator:
    def __init__(self, k: int):
        assert k > 0
        self.total_num = 0
        self.topk_correct_num = 0
        self.prediction_filter = TopKPredictionFilter(k)

    def add_predictions(self, predictions, targets):
        assert len(predictions) == len(targets)
        assert len(targets.shape) == 1

        n_sample = len(predictions)

        top_k_predictions = self.prediction_filter.filter(predictions, "indices")
        self.topk_correct_num += len(
            [1 for sample_idx in range(n_sample) if targets[sample_idx] in top_k_predictions[sample_idx]]
        )
        self.total_num += n_sample

    def get_report(self, **kwargs):
        return {
            f"accuracy_{self.prediction_filter.identifier}": float(self.topk_correct_num) / self.total_num
            if self.total_num
            else 0.0
        }


class MemorizingEverythingEvaluator:
    def __init__(self, prediction_filter=None):
        self.all_targets = np.array([])
        self.all_predictions = np.array([])
        self.prediction_filter = prediction_filter

    def add_predictions(self, predictions, targets):
        assert len(predictions) == len(targets)

        predictions = self.prediction_filter.filter(predictions, "vec") if self.prediction_filter else predictions

        if self.all_predictions.size != 0:
            self.all_predictions = np.append(self.all_predictions, predictions, axis=0)
        else:
            self.all_predictions = predictions.copy()

        if self.all_targets.size != 0:
            self.all_targets = np.append(self.all_targets, targets, axis=0)
        else:
            self.all_targets = targets.copy()

    def calculate_score(self, average="macro"):
        if self.all_predictions.size == 0:
            return 0.0

        tar_mat = _targets_to_mat(self.all_targets, self.all_predictions.shape[1])
        assert tar_mat.size == self.all_predictions.size
        result = 0.0
        if tar_mat.size > 0:
            non_empty_idx = np.where(np.invert(np.all(tar_mat == 0, axis=0)))[0]
            if non_empty_idx.size != 0:
                result = self._calculate(
                    tar_mat[:, non_empty_idx], self.all_predictions[:, non_empty_idx], average=average
                )

        return result

    def get_report(self, **kwargs):
        average = kwargs.get("average", "macro")
        return {self._get_id(): self.calculate_score(average)}


class BalancedAccuracyScoreEvaluator(MemorizingEverythingEvaluator):
    def _calculate(self, targets, predictions, average):
        single_targets = np.argmax(targets, axis=1)
        y_single_preds = np.argmax(predictions, axis=1)
        return sm.balanced_accuracy_score(single_targets, y_single_preds)

    def _get_id(self):
        return "balanced_accuracy"


class MeanAveragePrecisionNPointsEvaluator(MemorizingEverythingEvaluator):
    def __init__(self, n_points=11):
        super().__init__()
        self.ap_n_points_eval = []
        self.n_points = n_points

    def _calculate(self, targets, predictions, average):
        n_class = predictions.shape[1]
        return np.mean([self._per_class_calc(predictions[:, i], targets[:, i]) for i in range(n_class)])

    def _per_class_calc(self, predictions, targets):
        assert len(predictions) == len(targets)
        assert len(targets.shape) == 1

        precision, recall, _ = sm.precision_recall_curve(targets, predictions)
        recall_thresholds = np.linspace(1, 0, self.n_points, endpoint=True).tolist()
        precision_sum = 0
        recall_idx = 0
        precision_tmp = 0
        for threshold in recall_thresholds:
            while recall_idx < len(recall) and threshold <= recall[recall_idx]:
                precision_tmp = max(precision_tmp, precision[recall_idx])
                recall_idx += 1
            precision_sum += precision_tmp
        return precision_sum / self.n_points

    def _get_id(self):
        return f"mAP_{self.n_points}_points"


# ------------------------------------------------------------- vision_benchmark/evaluation/metric.py
def accuracy(y_label, y_pred):
    evaluator = TopKAccuracyEvaluator(1)
    evaluator.add_predictions(predictions=y_pred, targets=y_label)
    return evaluator.get_report()["accuracy_top1"]


def map_11_points(y_label, y_pred_proba):
    evaluator = MeanAveragePrecisionNPointsEvaluator(11)
    evaluator.add_predictions(predictions=y_pred_proba, targets=y_label)
    return evaluator.get_report()[evaluator._get_id()]


def balanced_accuracy_score(y_label, y_pred):
    evaluator = BalancedAccuracyScoreEvaluator()
    evaluator.add_predictions(y_pred, y_label)
    return evaluator.get_report()[evaluator._get_id()]


def get_metric(metric_name):
    if metric_name == "accuracy":
        return accuracy
    if metric_name == "mean-per-class":
        return balanced_accuracy_score
    if metric_name == "11point_mAP":
        return map_11_points
    raise ValueError(metric_name)  # port: the toolkit logs "Undefined metric." and returns None


# ------------------------------------------------------------- feature.py
class FeatureData(Dataset):
    def __init__(self, X, y):
        self.X = X
        self.y = y

    def __len__(self):
        return self.X.shape[0]

    def __getitem__(self, idx):
        return self.X[idx, :], self.y[idx]


def create_dataloader(dataset, batch_size, shuffle=True, num_workers=0, pin_memory=False):
    # port: num_workers 0 and no pinning (worker processes do not change the batch order)
    def seed_worker(worker_id):
        worker_seed = worker_id
        torch.manual_seed(worker_seed)
        np.random.seed(worker_seed)  # noqa: NPY002 (as the toolkit writes it)

    generator = torch.Generator()
    generator.manual_seed(0)

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=pin_memory,
        sampler=None,
        drop_last=False,
        worker_init_fn=seed_worker,
        generator=generator if shuffle else None,
    )
    return loader


# ------------------------------------------------------------- full_model_finetune.py
class Config(SimpleNamespace):
    """port: yacs' CfgNode as a namespace (defrost/freeze are no-ops)."""

    def defrost(self):
        pass

    def freeze(self):
        pass


def make_config(dim, n_classes, *, dataset="digits", metric="accuracy", epochs=10, extra_final=40, **train):
    """port: the config fields the linear probe reads, the toolkit's defaults but NESTEROV
    False (every shipped model config) and batch 64 (get_dataloader's default)."""
    t = dict(  # noqa: C408 (the config's field names)
        LR=0.001,
        WD=0.0001,
        SEARCH_WD_LOG_LOWER=-6,
        SEARCH_WD_LOG_UPPER=6,
        USE_CHANNEL_BN=True,
        INIT_HEAD_WITH_TEXT_ENCODER=False,
        LOGIT_SCALE_INIT="none",
        TRAINABLE_LOGIT_SCALE=False,
        NORMALIZE_VISUAL_FEATURE=False,
        SEARCH_RESULT_ON_LAST_EPOCH=False,
        MOMENTUM=0.9,
        WD_SEARCH_LEFT=False,
        NESTEROV=False,
        BEGIN_EPOCH=0,
        END_EPOCH=epochs,
        EXTRA_FINAL_TRAIN_EPOCH=extra_final,
        SCHEDULE=[],
        CLIP_GRAD_NORM=0.0,
        TEXT=None,
    )
    t.update(train)
    return Config(
        TRAIN=Config(**t),
        MODEL=Config(SPEC=Config(EMBED_DIM=dim)),
        DATASET=Config(NUM_CLASSES=n_classes, DATASET=dataset, MERGE_TRAIN_VAL_FINAL_RUN=True),
        TEST=Config(METRIC=metric),
        GPUS=[],
    )


def gpu_gc():
    pass  # port: gc.collect() and torch.cuda.empty_cache() free GPU memory; nothing to free here


class AverageMeter(object):  # noqa: UP004 (as the toolkit writes it)
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


class Classifier(torch.nn.Module):
    def __init__(self, config, l2_lambda):
        super(Classifier, self).__init__()  # noqa: UP008 (as the toolkit writes it)

        self.backbone = nn.Identity()  # port: features are the backbone's output

        input_dim, output_dim = config.MODEL.SPEC.EMBED_DIM, config.DATASET.NUM_CLASSES
        self.optim = None
        self.l2_lambda = l2_lambda
        self.channel_bn = torch.nn.BatchNorm1d(
            input_dim,
            affine=False,
        )
        # full_model_finetune.py:104: kaiming_uniform_ W then uniform_ b, from the global stream
        self.layers = torch.nn.Sequential(torch.nn.Linear(input_dim, output_dim))

        if config.TRAIN.INIT_HEAD_WITH_TEXT_ENCODER:
            # port: [D, K] normalised text, a fresh tensor per Classifier as extract_text_features
            # returns one (as_tensor would share the array, and training would write into it)
            zeroshot_weights = torch.tensor(config.TRAIN.TEXT).T
            self.layers[0].weight.data = (
                zeroshot_weights.T.to(self.layers[0].weight.dtype).to(self.layers[0].weight.device).contiguous()
            )
            self.layers[0].bias.data.fill_(0.0)

        self.logit_scale = nn.Parameter(torch.ones([]))
        self.logit_scale.requires_grad = config.TRAIN.TRAINABLE_LOGIT_SCALE
        if config.TRAIN.LOGIT_SCALE_INIT == "ln_cls":
            self.logit_scale.data *= np.log(np.log(config.DATASET.NUM_CLASSES))
        elif config.TRAIN.LOGIT_SCALE_INIT == "clip":
            self.logit_scale.data *= np.log(1 / 0.07)
        else:
            self.logit_scale.data *= 0

        self.normalize_visual_output = config.TRAIN.NORMALIZE_VISUAL_FEATURE

        if not config.TRAIN.USE_CHANNEL_BN:
            self.channel_bn = nn.Identity()

    def forward(self, img):
        pdtype = img.dtype
        feature = self.backbone(img).to(pdtype)
        outputs = self.channel_bn(feature)

        if self.normalize_visual_output:
            outputs = F.normalize(outputs)

        outputs = self.logit_scale.exp() * self.layers(outputs)
        return outputs


def build_optimizer(cfg, model):
    """optim/build.py: ``_set_wd`` with an empty WITHOUT_WD_LIST, then the plain SGD branch."""
    with_decay = []
    without_decay = []
    for _n, p in model.named_parameters():
        if p.requires_grad is False:
            continue
        with_decay.append(p)
    params = [{"params": with_decay}, {"params": without_decay, "weight_decay": 0.0}]
    return torch.optim.SGD(
        params, lr=cfg.TRAIN.LR, momentum=cfg.TRAIN.MOMENTUM, weight_decay=cfg.TRAIN.WD, nesterov=cfg.TRAIN.NESTEROV
    )


def hyperparameter_sweep(train_dataloader, val_dataloader, config):
    l2_lambda_list = np.logspace(config.TRAIN.SEARCH_WD_LOG_LOWER, config.TRAIN.SEARCH_WD_LOG_UPPER, num=97).tolist()
    l2_lambda_init_idx = [
        i
        for i, val in enumerate(l2_lambda_list)
        if val in set(np.logspace(config.TRAIN.SEARCH_WD_LOG_LOWER, config.TRAIN.SEARCH_WD_LOG_UPPER, num=7))
    ]
    peak_idx = -1
    peak_score = 0
    iter_num = 0
    for idx in l2_lambda_init_idx:  # full_model_finetune.py:168-181: the 7 coarse points
        config.defrost()
        config.TRAIN.WD = l2_lambda_list[idx]

        try:
            best_score_ = train_task(train_dataloader, val_dataloader, config, sweep_run=True)
        except Exception:  # port: the toolkit's bare ``except:``
            best_score_ = 0.0
            gpu_gc()
            continue

        if best_score_ > peak_score:
            peak_idx = idx
            peak_score = best_score_

    # :184-211: neighbours at spans 8, 4, 2, 1; every one is a new train_task (a new head from
    # the stream's next draws), also an index scored before or both clipped ends at one index
    step_span = 8
    while step_span > 0:
        left, right = max(peak_idx - step_span, 0), min(peak_idx + step_span, len(l2_lambda_list) - 1)
        search_idx = []
        if left != peak_idx:
            search_idx.append(left)
        if right != peak_idx:
            search_idx.append(right)
        for idx in search_idx:
            if config.TRAIN.WD_SEARCH_LEFT:
                config.TRAIN.WD = l2_lambda_list[left]
            else:
                config.TRAIN.WD = l2_lambda_list[idx]

            try:
                best_score_ = train_task(train_dataloader, val_dataloader, config, sweep_run=True)
            except Exception:
                best_score_ = 0.0
                gpu_gc()
                continue

            if best_score_ > peak_score:
                peak_idx = idx
                peak_score = best_score_
        iter_num += 1
        step_span //= 2

    return l2_lambda_list[peak_idx], peak_score


def clone_loader(loader, shuffle=True):
    return create_dataloader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=shuffle,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


def train_task(train_dataloader, test_dataloader, config, sweep_run=False):
    best_acc1 = 0

    # full_model_finetune.py:232: the head's nn.Linear (:104) draws from the running global stream
    model = Classifier(config, 0)

    # :236: a new shuffled loader, its own generator seeded 0 (feature.py:84-85): no global draw
    train_dataloader = clone_loader(train_dataloader)

    if config.DATASET.DATASET in MULTILABEL_DATASETS:
        criterion = torch.nn.BCEWithLogitsLoss()
    else:
        criterion = torch.nn.CrossEntropyLoss()

    optimizer = build_optimizer(config, model)

    model_info = {"acc1_per_epoch": []}  # port: the per-epoch record

    for epoch in range(config.TRAIN.BEGIN_EPOCH, config.TRAIN.END_EPOCH):
        adjust_learning_rate(optimizer, epoch, config)

        # train for one epoch
        train_one(train_dataloader, model, criterion, optimizer, epoch, config)

        # evaluate on validation set (:270): iterating the unshuffled loader draws one base seed
        # from the global stream (torch _BaseDataLoaderIter.__init__, generator=None)
        acc1, logits = validate(test_dataloader, model, criterion, epoch, config, return_logits=True)
        model_info["acc1_per_epoch"].append(acc1)

        # remember best acc@1 and save checkpoint
        if acc1 > best_acc1:
            model_info["best_logits"] = logits
        best_acc1 = max(acc1, best_acc1)

    model_info["model"] = model  # port: the trained head, for tests

    if sweep_run:  # port: each trial's score, for tests
        score = acc1 if config.TRAIN.SEARCH_RESULT_ON_LAST_EPOCH else best_acc1
        TRIALS.append((config.TRAIN.LR, config.TRAIN.WD, score, list(model_info["acc1_per_epoch"])))

    if sweep_run and config.TRAIN.SEARCH_RESULT_ON_LAST_EPOCH:
        return acc1

    del criterion, optimizer
    gpu_gc()

    if sweep_run:
        return best_acc1
    else:
        return best_acc1, model_info


def train_one(train_loader, model, criterion, optimizer, epoch, config):
    batch_time = AverageMeter()
    data_time = AverageMeter()
    losses = AverageMeter()

    model.train()

    end = time.time()
    for _, batch in enumerate(train_loader):
        images, target = batch[:2]

        # measure data loading time
        data_time.update(time.time() - end)

        if images.shape[0] == 1:
            continue  # TODO: check this fix on batch left is size-1
        if target.shape[-1] == 1:
            target = target[:, 0]

        # compute gradient and do SGD step
        optimizer.zero_grad()
        output = model.forward(images)

        loss = criterion(output, target)
        loss.backward()

        if config.TRAIN.CLIP_GRAD_NORM > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.TRAIN.CLIP_GRAD_NORM)

        optimizer.step()
        losses.update(loss.item(), images.size(0))

        batch_time.update(time.time() - end)
        end = time.time()
    # port: the train-set metric the toolkit only logs is not computed


@torch.no_grad()
def validate(val_loader, model, criterion, epoch, config, return_logits=False):
    metric = get_metric(config.TEST.METRIC)

    outputs = []
    targets = []

    model.eval()
    # full_model_finetune.py:362: the iterator's __init__ draws its int64 base seed from the
    # global stream (the loader's generator is None: feature.py:96)
    for batch in val_loader:
        images, target = batch[:2]

        if target.shape[-1] == 1:
            target = target[:, 0]

        # compute output
        output = model(images)
        outputs.append(output)
        targets.append(target)

    outputs = torch.cat(outputs, dim=0)
    targets = torch.cat(targets, dim=0)
    logits = outputs.softmax(-1).data.cpu().numpy()
    labels = targets.data.cpu().numpy()
    try:
        metric_result = 100.0 * metric(labels, logits)
    except Exception:
        metric_result = 0.0

    if return_logits:
        return metric_result, logits
    else:
        return metric_result


def adjust_learning_rate(optimizer, epoch, config):
    lr = config.TRAIN.LR
    for milestone in config.TRAIN.SCHEDULE:
        lr *= 0.1 if epoch >= milestone else 1.0
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def hyperparameter_sweep_lr(train_dataloader, val_dataloader, config):
    # full_model_finetune.py:422-442: the 6 learning rates in order, one weight-decay search each
    learning_rate_list = np.logspace(-6, -1, num=6).tolist()
    best_score = 0
    best_lr = 0
    best_l2_lambda = 0
    for lr_one in learning_rate_list:
        config.defrost()
        config.TRAIN.LR = lr_one
        config.freeze()
        l2_lambda, best_score_one = hyperparameter_sweep(train_dataloader, val_dataloader, config)
        if best_score < best_score_one:
            best_score = best_score_one
            best_lr = lr_one
            best_l2_lambda = l2_lambda
    return best_lr, best_l2_lambda


def merge_trainval_loader(train_loader, val_loader):
    trainset, valset = train_loader.dataset, val_loader.dataset
    fullset = trainset.dataset
    assert trainset.dataset is valset.dataset
    assert len(fullset) == len(trainset) + len(valset)

    return create_dataloader(
        fullset,
        batch_size=train_loader.batch_size,
        shuffle=True,
        num_workers=train_loader.num_workers,
        pin_memory=train_loader.pin_memory,
    )


def full_model_finetune(train_dataloader, val_dataloader, test_dataloader, no_hyperparameter_tuning, lr, l2, config):
    if no_hyperparameter_tuning:
        best_lr = lr
        best_l2_lambda = l2
    else:
        best_lr, best_l2_lambda = hyperparameter_sweep_lr(train_dataloader, val_dataloader, config)

    config.defrost()
    config.TRAIN.LR = best_lr
    config.TRAIN.WD = best_l2_lambda
    config.TRAIN.END_EPOCH += config.TRAIN.EXTRA_FINAL_TRAIN_EPOCH
    config.freeze()

    if config.DATASET.MERGE_TRAIN_VAL_FINAL_RUN:
        trainval_dataloader = merge_trainval_loader(train_dataloader, val_dataloader)
    else:
        trainval_dataloader = train_dataloader
    # :493: the final head draws from the stream where the search left it (no reseeding)
    best_acc1, model_info = train_task(trainval_dataloader, test_dataloader, config)
    model_info.update(lr=best_lr, wd=best_l2_lambda)  # port: the selection, for tests
    return best_acc1, model_info


# ------------------------------------------------------------- commands/linear_probe.py
def fix_seed(seed):
    """linear_probe.py:62-66 (``--fix_seed``, default 0): the process's streams seeded once,
    before the data loaders and every ``train_task``; nothing seeds them again."""
    if seed != -1:
        random.seed(seed)
        np.random.seed(seed)  # noqa: NPY002 (as the toolkit writes it)
        torch.manual_seed(seed)
        # port: torch.cuda.manual_seed_all(seed) seeds GPU streams, which nothing here uses


# ------------------------------------------------------------- glue for tests (not the toolkit's)
#: (lr, wd, score, per-epoch scores; in percent) of every search trial in order, appended by
#: train_task (port)
TRIALS: list = []


def run_seeded(seed, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` after :func:`fix_seed` (``seed``), as one toolkit process runs
    it; :data:`TRIALS` starts empty. The caller's global torch/numpy/random states are restored."""
    TRIALS.clear()
    np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002
    try:
        with torch.random.fork_rng(devices=[]):
            fix_seed(seed)
            return fn(*args, **kwargs)
    finally:
        np.random.set_state(np_state)  # noqa: NPY002
        random.setstate(py_state)


def loaders(X_full, y_full, train_idx, val_idx, X_test, y_test, batch_size=64):
    """get_dataloader's two Subset loaders over one dataset (train shuffled, val not) and the
    unshuffled test loader, from float32 features and labels (int [n] or 0/1 [n, C])."""
    multi = np.asarray(y_full).ndim == 2
    dt = torch.float32 if multi else torch.int64

    def data(X, y):
        return FeatureData(torch.as_tensor(np.asarray(X, np.float32)), torch.as_tensor(np.asarray(y), dtype=dt))

    full = data(X_full, y_full)
    tr = create_dataloader(Subset(full, list(train_idx)), batch_size, shuffle=True)
    va = create_dataloader(Subset(full, list(val_idx)), batch_size, shuffle=False)
    te = create_dataloader(data(X_test, y_test), batch_size, shuffle=False)
    return tr, va, te


def predict_proba(model, X) -> np.ndarray:
    """validate's ``outputs.softmax(-1)`` of a trained Classifier on features ``X``."""
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(X, np.float32))).softmax(-1).double().numpy()
