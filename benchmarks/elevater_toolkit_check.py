"""featcache's ELEVATER linear probe against the ELEVATER toolkit's OWN code (issue 49).

Imports Computer-Vision-in-the-Wild/Elevater_Toolkit_IC's ``vision_benchmark.evaluation``
(``full_model_finetune.py``: ``full_model_finetune``, ``hyperparameter_sweep_lr``,
``hyperparameter_sweep``, ``train_task``, ``Classifier``; ``feature.py``:
``create_dataloader``, ``FeatureData``; ``optim/build.py``; ``metric.py`` with
vision-evaluation) from a checkout given on the command line (nothing of it is copied here), and
runs it as ``commands/linear_probe.py`` does: ``--fix_seed 0`` (linear_probe.py:62-66: random,
numpy and torch seeded once), the default config with a shipped model config's training fields
(SGD momentum 0.9, no Nesterov, batch 64, 10 search epochs per trial, final run 10 + 40 = 50
epochs on train+val), then ``full_model_finetune(train, val, test, False, ...)``. What had to
change to run it on cached features on a CPU, and nothing else:

* the backbone is ``torch.nn.Identity()`` (``get_model`` replaced in the module; the features
  are the backbone's output, and the identity draws nothing from the random stream);
* every ``.cuda()`` is a no-op (``Tensor.cuda``/``Module.cuda``/``torch.cuda.set_device``
  patched for the run, then restored);
* the loaders are the toolkit's ``create_dataloader`` with ``num_workers=0, pin_memory=False``
  (worker processes fetch the same batches; the main process draws the same seeds) over the
  rows of featcache's ``elevater-fewshot:5`` seed-0 plan: the Subset indices of the toolkit's
  class-balanced 20 % holdout (``get_dataloader``, feature.py:137-149) inside the 5-shot pool.

The toolkit's ``train_task`` and ``validate`` are wrapped (their originals called unchanged)
to record each search trial's score and each final-run epoch's test accuracy. featcache runs
``fit_elevater`` on the same rows and both are printed side by side, with every trial compared.

Fixtures: ``pixels``, scikit-learn's digits pixels (64-d, 0..16) in the store's train/test
split (``pixels255``: the same scaled to the 0..255 images the store's digits reader makes); ``lite0``, the tf_efficientnet_lite0 digits features of a store (the tests' session
store, e.g. ``$FEATCACHE_TEST_CACHE/digits.zarr``).

The toolkit's requirements that featcache lacks go in a throwaway folder, never featcache's
environment::

    git clone <Elevater_Toolkit_IC> /tmp/elevater-toolkit && git -C /tmp/elevater-toolkit checkout 00d0af78
    pip install --target /tmp/elev-pkgs --no-deps yacs vision-evaluation==0.2.9 \\
        vision-datasets==0.2.17 nltk opencv-python-headless pycocotools timm==0.4.12
    PYTHONPATH=/tmp/elev-pkgs:$PYTHONPATH python benchmarks/elevater_toolkit_check.py \\
        /tmp/elevater-toolkit --store $FEATCACHE_TEST_CACHE/digits.zarr --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import sys
from dataclasses import replace

import numpy as np

LITE0 = "tf_efficientnet_lite0"


def _splits(store: str, fixture: str):
    """(train SplitData, (X_test float32, y_test)) of one fixture, rows in the store's id order."""
    from featcache.probes import runner as PR
    from featcache.store import open_cache

    c = open_cache(store)
    tr, te = (PR._load_split(c, LITE0, "digits", s, "pooled") for s in ("train", "test"))
    if fixture in ("pixels", "pixels255"):
        from sklearn.datasets import load_digits

        pixels = load_digits().data  # 0..16
        if fixture == "pixels255":  # the store's digits images (extract/readers/folders.py)
            pixels = (pixels * (255.0 / 16.0)).round()

        def rows(ids):
            return pixels[[int(i.removeprefix("digits-")) for i in ids]]

        tr, te = replace(tr, X=rows(tr.ids)), replace(te, X=rows(te.ids))
    return tr, (np.asarray(te.X, np.float32), np.asarray(te.y))


@contextlib.contextmanager
def _cpu_only():
    """The toolkit's ``.cuda()`` calls as no-ops for the run (restored after)."""
    import torch

    saved = torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.set_device
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.set_device = saved


def _config(base, dim: int, n_classes: int, search_epochs: int, final_epochs: int):
    """The toolkit's default config with a shipped model config's TRAIN fields
    (resources/model/vit_base_patch16_224.yaml: NESTEROV false, MOMENTUM 0.9, WD 0.)."""
    cfg = base.clone()
    cfg.defrost()
    cfg.MODEL.NAME = "identity"
    cfg.MODEL.SPEC.EMBED_DIM = dim
    cfg.DATASET.DATASET = "digits"
    cfg.DATASET.NUM_CLASSES = n_classes
    cfg.DATASET.NUM_SAMPLES_PER_CLASS = 5
    cfg.TEST.METRIC = "accuracy"
    cfg.TRAIN.OPTIMIZER = "sgd"
    cfg.TRAIN.MOMENTUM = 0.9
    cfg.TRAIN.NESTEROV = False
    cfg.TRAIN.WD = 0.0
    cfg.TRAIN.BEGIN_EPOCH = 0
    cfg.TRAIN.END_EPOCH = search_epochs
    cfg.TRAIN.EXTRA_FINAL_TRAIN_EPOCH = final_epochs - search_epochs
    cfg.VERBOSE = False
    cfg.freeze()
    return cfg


def run_toolkit(checkout: str, train, test, search_epochs: int, final_epochs: int) -> dict:
    """The toolkit's ``full_model_finetune`` on the fixture's 5-shot seed-0 rows."""
    import torch

    sys.path.insert(0, checkout)
    fmf = importlib.import_module("vision_benchmark.evaluation.full_model_finetune")
    feat = importlib.import_module("vision_benchmark.evaluation.feature")
    from vision_benchmark.config import config as base

    from featcache.core import protocols as P

    sp = P.get_protocol("elevater-fewshot:5").plan(
        train.y, 0, val_source="auto", train_name=train.name, rows=train.rows
    )
    fin = np.asarray(sp.final)
    at = {int(p): i for i, p in enumerate(fin)}
    ti, vi = ([at[int(p)] for p in pos] for pos in (sp.train, sp.val))
    assert ti == sorted(ti), "Subset(list(set(...))) keeps the dataset order"
    assert vi == sorted(vi), "Subset(list(set(...))) keeps the dataset order"
    classes = np.unique(train.y[np.asarray(sp.train)])
    X = torch.as_tensor(np.asarray(train.X, np.float32)[fin])
    y = torch.as_tensor(np.searchsorted(classes, train.y[fin]), dtype=torch.int64)
    full = feat.FeatureData(X, y)

    def loader(ds, shuffle):
        return feat.create_dataloader(ds, batch_size=64, shuffle=shuffle, num_workers=0, pin_memory=False)

    tr = loader(torch.utils.data.Subset(full, ti), True)
    va = loader(torch.utils.data.Subset(full, vi), False)
    te = loader(feat.FeatureData(torch.as_tensor(test[0]), torch.as_tensor(test[1], dtype=torch.int64)), False)
    cfg = _config(base, X.shape[1], classes.size, search_epochs, final_epochs)

    rec: dict = {"trials": [], "test_epochs": []}
    saved = {k: getattr(fmf, k) for k in ("train_task", "validate", "get_model", "hyperparameter_sweep_lr")}

    def train_task(train_dataloader, test_dataloader, config, sweep_run=False):
        out = saved["train_task"](train_dataloader, test_dataloader, config, sweep_run=sweep_run)
        if sweep_run:
            rec["trials"].append((config.TRAIN.LR, config.TRAIN.WD, out / 100))
        return out

    def validate(val_loader, *a, **k):
        out = saved["validate"](val_loader, *a, **k)
        if val_loader is te:
            rec["test_epochs"].append((out[0] if isinstance(out, tuple) else out) / 100)
        return out

    def sweep_lr(*a, **k):
        rec["selected"] = saved["hyperparameter_sweep_lr"](*a, **k)
        return rec["selected"]

    fmf.train_task, fmf.validate, fmf.hyperparameter_sweep_lr = train_task, validate, sweep_lr
    fmf.get_model = lambda config, feature_type="image": torch.nn.Identity()
    try:
        with _cpu_only(), torch.random.fork_rng(devices=[]):
            import random

            # commands/linear_probe.py:62-66, --fix_seed 0
            random.seed(0)
            np.random.seed(0)  # noqa: NPY002 (the toolkit's global seeding)
            torch.manual_seed(0)
            # linear_probe.py:98: full_model_finetune(train, val, test, args.no_tuning=False, ...)
            best_acc, _ = fmf.full_model_finetune(tr, va, te, False, 0.001, 0.316, cfg)
    finally:
        for k, v in saved.items():
            setattr(fmf, k, v)
    return {
        "lr": rec["selected"][0],
        "wd": rec["selected"][1],
        "top1_last_epoch": rec["test_epochs"][-1],
        "top1_best_test_epoch": best_acc / 100,
        "trials": rec["trials"],
    }


def run_featcache(train, test, search_epochs: int, final_epochs: int) -> dict:
    """featcache's ``fit_elevater`` (the ``elevater-fewshot:5`` solver) on the same rows."""
    from featcache.core import protocols as P
    from featcache.core.metrics import top1
    from featcache.probes import runner as PR
    from featcache.probes.elevater import fit_elevater
    from featcache.probes.solvers import FitRequest

    proto = P.get_protocol("elevater-fewshot:5")
    plan = PR._plan(proto, 0, train, None, "auto")
    opts = {"search_epochs": search_epochs, "final_epochs": final_epochs, "final_epoch": "best-test", "metric": None}
    out = fit_elevater(FitRequest(proto, plan, opts, None, 0))
    hp = out.hparams
    per_epoch = [top1(test[1], p(test[0])) for p in out.epoch_predicts]
    return {
        "lr": hp["lr"],
        "wd": hp["weight_decay"],
        "top1_last_epoch": per_epoch[-1],
        "top1_best_test_epoch": max(per_epoch),
        "trials": [(r["lr"], w, v) for r in hp["per_lr"] for w, v in r["trial_scores"]],
    }


def compare(tk: dict, fc: dict) -> dict:
    """Side by side, with the trials that differ (by (lr, wd) to 1e-12 relative, or score)."""
    n = max(len(tk["trials"]), len(fc["trials"]))
    diff = []
    for i in range(n):
        a = tk["trials"][i] if i < len(tk["trials"]) else None
        b = fc["trials"][i] if i < len(fc["trials"]) else None
        if a is None or b is None or not np.allclose(a, b, rtol=1e-12, atol=1e-12):
            diff.append({"trial": i, "toolkit": a, "featcache": b})
    same = bool(np.isclose(tk["lr"], fc["lr"], rtol=1e-12) and np.isclose(tk["wd"], fc["wd"], rtol=1e-12))
    return {
        "same_lr_wd": same,
        "same_top1_last_epoch": abs(tk["top1_last_epoch"] - fc["top1_last_epoch"]) <= 1e-12,  # x/100*100
        "trials": (len(tk["trials"]), len(fc["trials"])),
        "trials_differing": diff[:10],
        "n_trials_differing": len(diff),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="an Elevater_Toolkit_IC checkout (commit 00d0af78)")
    ap.add_argument("--store", required=True, help="a store with lite0 digits train/test features")
    ap.add_argument("--fixtures", nargs="+", default=["pixels", "lite0"], choices=["pixels", "pixels255", "lite0"])
    ap.add_argument("--search-epochs", type=int, default=10)
    ap.add_argument("--final-epochs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    res = {"threads": args.threads, "search_epochs": args.search_epochs, "final_epochs": args.final_epochs}
    for fx in args.fixtures:
        train, test = _splits(args.store, fx)
        tk = run_toolkit(args.checkout, train, test, args.search_epochs, args.final_epochs)
        fc = run_featcache(train, test, args.search_epochs, args.final_epochs)
        res[fx] = {"toolkit": tk, "featcache": fc, "compare": compare(tk, fc)}
        for who, r in (("toolkit", tk), ("featcache", fc)):
            print(
                f"{fx:9s} {who:9s} lr {r['lr']:.0e} wd {r['wd']:.3g} top-1 last {r['top1_last_epoch']:.4f} "
                f"best-test {r['top1_best_test_epoch']:.4f} trials {len(r['trials'])}"
            )
        c = res[fx]["compare"]
        print(f"{fx:9s} same (lr, wd): {c['same_lr_wd']}, same top-1: {c['same_top1_last_epoch']}, "
              f"trials differing: {c['n_trials_differing']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
