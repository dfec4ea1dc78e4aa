"""``featcache extract``."""

from __future__ import annotations

import argparse
from typing import cast

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 10


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`~featcache.extract.config.ExtractConfig` (its single source)."""
    from featcache.extract.config import ExtractConfig
    from featcache.store import add_storage_option_argument

    ExtractConfig.add_arguments(p, optional=("data",))
    # --splits: the field's own name, a second spelling of the --split flag (one action, one dest)
    split = next(a for a in p._actions if a.dest == "splits")
    cast(list, split.option_strings).append("--splits")
    p._option_string_actions["--splits"] = split
    p.set_defaults(resize=None, data=None)  # resize None: the suite's (VTAB: whole-tf1), else timm
    from featcache.suites import suite_names

    p.add_argument(
        "--suite",
        default=None,
        help=f"extract every task of a suite ({suite_names()}; see `featcache suites`) whose "
        "data is under --data-root; uses the suite's resize and input size unless given",
    )
    p.add_argument(
        "--data-root",
        default=None,
        help="with --suite: folder holding one entry per task "
        "(DIR/<task>: VTAB-1k lists, CLIP_benchmark shards, HF on disk, image folder; DIR/<task>.csv)",
    )
    add_storage_option_argument(p)
    from featcache.core.tracking import add_track_argument

    add_track_argument(p)


def run_extract(args: argparse.Namespace) -> int:
    """``featcache extract``: build the config, tune the CPU allocator (this command only;
    :mod:`featcache.core.allocator`), run the stage, print one line per split."""
    from featcache.errors import ConfigError
    from featcache.extract.config import ExtractConfig
    from featcache.store import parse_storage_options

    opts = parse_storage_options(args.storage_options)
    progress = getattr(args, "progress", True) and not getattr(args, "no_progress", False)  # -q: none
    if args.suite:
        if args.data:
            raise ConfigError("give either --data (one dataset) or --suite with --data-root, not both")
        configs = suite_configs(args, storage_options=opts)
    elif args.data_root:
        raise ConfigError("--data-root goes with --suite NAME; for one dataset give --data SPEC")
    elif not args.data:
        raise ConfigError("give --data SPEC (one dataset) or --suite NAME --data-root DIR (see `featcache suites`)")
    else:
        configs = [(ExtractConfig.from_args(args, storage_options=opts), None)]
    configs = [(c.replace(progress=progress), task) for c, task in configs]
    import functools

    from featcache.core.tracking import open_tracking

    tracking = open_tracking(getattr(args, "track", None))
    if _runs_on_cpu(configs[0][0].device):
        from featcache.core.allocator import tune_cpu_allocator

        tune_cpu_allocator()
    from featcache.extract.pipeline import dist_info, extract

    for cfg, task in configs:
        reports = extract(cfg, on_size=print)  # the store size needed, before any image is read
        if dist_info()[0] == 0:
            if task is not None and cfg.write:
                _record_task_metric(cfg, task)
            _print_reports(reports)
            if tracking is not None:  # after the features are stored: a tracker never costs them
                tracking.log(functools.partial(tracked_splits, cfg, reports))
    return 0


def tracked_splits(cfg, reports) -> list:
    """One :class:`~featcache.core.tracking.TrackedRun` per extracted split: its id a run id of
    (store, backbone, dataset, split), so extracting it again updates the tracked run; params =
    the config, metrics = what the split's extraction did, artifacts = ``store_summary.json``
    (the store's catalog rows of that split: kinds, shapes, provenance), ``config.json`` and
    ``report.md``."""
    import json

    from featcache.core.results import make_run_id
    from featcache.core.tracking import TrackedRun, config_params
    from featcache.store import open_cache

    cat = open_cache(cfg.cache, storage_options=dict(cfg.storage_options or {}) or None).catalog()
    params = {f"config.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in config_params(cfg).items()}
    out = []
    for r in reports:
        mine = [
            c for c in cat.to_dicts() if (c["backbone"], c["dataset"], c["split"]) == (r.backbone, r.dataset, r.split)
        ]
        figures = {"rows": r.n, "chunks_total": r.chunks_total, "chunks_computed": r.chunks_computed}
        figures.update({"n_invalid": r.n_invalid, "seconds": r.seconds, "images_per_s": r.images_per_s})
        report = f"# extract {r.backbone} {r.dataset}/{r.split}\n\n" + "".join(
            f"- {k}: {v}\n" for k, v in figures.items()
        )
        files = {
            "store_summary.json": json.dumps(mine, indent=1, sort_keys=True, default=str),
            "config.json": json.dumps(config_params(cfg), indent=1, sort_keys=True),
            "report.md": report,
        }
        split = {"backbone": r.backbone, "dataset": r.dataset, "split": r.split}
        rid = make_run_id(kind="extract", cache=str(cfg.cache), **split)
        metrics = {k: float(v) for k, v in figures.items() if v is not None}
        name = f"extract {r.backbone} {r.dataset}/{r.split}"
        out.append(TrackedRun(rid, "extract", name, {**split, **params}, metrics, files, {"featcache.kind": "extract"}))
    return out


def suite_configs(args: argparse.Namespace, **overrides) -> list:
    """``(ExtractConfig, Task)`` per task of ``--suite`` whose data is under ``--data-root``
    (dataset key = task name, or ``<--dataset-name>-<task>``); the missing tasks are named in
    one warning, and none present is an error."""
    from featcache.extract.config import ExtractConfig
    from featcache.suites import load_suite, present_tasks

    suite = load_suite(args.suite)
    kw = {"resize": args.resize or suite.resize, "input_size": args.input_size or suite.input_size}
    prefix = f"{args.dataset_name}-" if args.dataset_name else ""
    return [
        (ExtractConfig.from_args(args, data=spec, dataset_name=prefix + task.name, **kw, **overrides), task)
        for task, spec in present_tasks(suite, args.data_root)
    ]


def _record_task_metric(cfg, task) -> None:
    """Declare the suite task's metric on its dataset in the store, so probes select on it."""
    from featcache.store import open_cache, write_task_metric

    cache = open_cache(cfg.cache, "a", storage_options=dict(cfg.storage_options or {}) or None)
    write_task_metric(cache, cfg.dataset_name, task.metric)


def _print_reports(reports) -> None:
    for r in reports:
        if r.skipped:
            print(f"{r.backbone} {r.dataset}/{r.split}: already complete ({r.n} rows), nothing to do")
        else:
            print(
                f"{r.backbone} {r.dataset}/{r.split}: {r.n} rows, {r.chunks_computed}/{r.chunks_total} chunks "
                f"computed in {r.seconds:.1f}s ({r.images_per_s or 0:.1f} img/s), {r.n_invalid} unreadable"
            )
            for sid, err in r.failures[:5]:
                print(f"  unreadable {sid}: {err}")
            if r.n_invalid > 5:
                print(f"  ... {r.n_invalid - 5} more (stored as valid=False with their error text)")


def _runs_on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def run_embed_classes(args: argparse.Namespace) -> int:
    """``featcache embed-classes``: class names x templates through the text tower, stored."""
    from featcache.extract.text import run

    key, m = run(
        args.cache,
        args.model,
        args.weights,
        args.dataset,
        args.templates,
        backbone=args.backbone,
        name=args.name,
        overwrite=args.overwrite,
        device=args.device,
        classnames=args.classnames,
        prompt_dataset=args.prompt_dataset,
    )
    print(f"class embeddings {args.dataset}/{key}/{args.name}: {m.shape[0]} classes, {m.shape[1]}-d")
    return 0


def run_embed_captions(args: argparse.Namespace) -> int:
    """``featcache embed-captions``: the captions of stored images through the text tower."""
    from featcache.extract.captions import run

    key, n_img, n_txt = run(
        args.cache,
        args.model,
        args.weights,
        args.dataset,
        args.split,
        args.captions,
        backbone=args.backbone,
        device=args.device,
    )
    print(f"caption embeddings {args.dataset}/{args.split}/{key}: {n_txt} captions of {n_img} images")
    return 0


def run_models(args: argparse.Namespace) -> int:
    """``featcache models``: the names each installed source offers, and whether cached."""
    from featcache.models.catalog import list_models

    n = 0
    for e in list_models(args.pattern, args.source):
        if args.cached and not e.cached:
            continue
        print(f"{e.source:<12} {e.model:<48} {e.weights:<32} {'cached' if e.cached else '-'}")
        n += 1
    if not n:
        print(f"no model matches {args.pattern!r}" + (" in the caches" if args.cached else ""))
    return 0


def run_fetch_weights(args: argparse.Namespace) -> int:
    """``featcache fetch-weights``: pre-fetch models (connected), or ``--verify`` them offline."""
    from featcache.models import catalog

    if args.verify:
        for r in catalog.verify(args.verify):
            print(f"ok {r['model']} ({r['weights']}): sha256 {r['weights_sha256'][:16]} revision {r['revision']}")
        return 0
    for r in catalog.fetch(catalog.check_items(args.model, args.weights, args.list), args.manifest, force=args.force):
        print(f"fetched {r['model']} ({r['weights']}): sha256 {r['weights_sha256'][:16]} revision {r['revision']}")
    if args.manifest:
        print(f"manifest {args.manifest}: verify offline with featcache fetch-weights --verify {args.manifest}")
    return 0


def _text_tower_arguments(p: argparse.ArgumentParser, cache_help: str, dataset_help: str) -> None:
    """The flags of a command that embeds text with a backbone's text tower (embed-classes,
    embed-captions): the store, the dataset, the backbone and its model, weights and device."""
    p.add_argument("--cache", required=True, help=cache_help)
    p.add_argument(
        "--model",
        default=None,
        help="open_clip:ARCH | hf:DIR|ORG/NAME (a CLIPModel), as for extract; default: the model recorded for "
        "--backbone's features (the text tower follows the image tower)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="as for extract (a tag, random:SEED, a checkpoint; hf: the model's own); default: --backbone's recorded",
    )
    p.add_argument("--dataset", required=True, help=dataset_help)
    p.add_argument("--backbone", default=None, help="backbone key in the store (default: as extract names it)")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")


def register(sub) -> None:
    from featcache.models.sources import LISTINGS

    p = sub.add_parser("extract", help="run a backbone over a dataset into the feature cache")
    add_extract_arguments(p)
    p.set_defaults(func=run_extract)
    e = sub.add_parser(
        "embed-classes", help="class embeddings from a backbone's text tower (zeroshot, --head-init text)"
    )
    _text_tower_arguments(
        e, "feature cache holding --dataset", "dataset key in the store (its class names are embedded)"
    )
    e.add_argument(
        "--templates",
        default="clip-imagenet",
        help="clip-imagenet (CLIP's 80 prompts) | simple | elevater (ELEVATER's per dataset) | clip-benchmark "
        "(CLIP_benchmark's per dataset) | FILE (one template per line with {} or {c}, as CLIP_benchmark's "
        "zeroshot_classification_templates.txt; a JSON list; a JSON object dataset -> list)",
    )
    e.add_argument(
        "--classnames",
        default=None,
        help="store | elevater | clip-benchmark | FILE (one name per line, as CLIP_benchmark's classnames.txt; "
        "or JSON); default: ELEVATER's with --templates elevater, CLIP_benchmark's with --templates "
        "clip-benchmark where it names the dataset, else the store's",
    )
    e.add_argument(
        "--prompt-dataset",
        default=None,
        help="the dataset's name in ELEVATER's / CLIP_benchmark's sets (default: --dataset, matched by letters "
        "and digits and by the elevater-ic suite's task names)",
    )
    e.add_argument("--name", default="text", help="embedding name (--head-init NAME)")
    e.add_argument("--overwrite", action="store_true", help="replace embeddings made with another tower/templates")
    e.set_defaults(func=run_embed_classes)
    c = sub.add_parser(
        "embed-captions", help="caption embeddings from a backbone's text tower (featcache retrieve-text)"
    )
    _text_tower_arguments(c, "feature cache holding the images' features", "dataset key in the store")
    c.add_argument("--split", default="test", help="split of the captioned images (default test)")
    c.add_argument(
        "--captions",
        required=True,
        help="CLIP_benchmark's retrieval export DIR (<split>/*.tar with .txt captions, one per line) or a "
        "manifest CSV/parquet with a caption column and id (or path); several rows or lines = several captions",
    )
    c.set_defaults(func=run_embed_captions)
    m = sub.add_parser("models", help="list/search the model names each installed source offers, and what is cached")
    m.add_argument(
        "pattern", nargs="?", default="*", help="a substring or fnmatch pattern (e.g. 'vit_small*', 'ViT-B-32')"
    )
    listed = " | ".join(LISTINGS)  # the sources that list their models, as registered
    m.add_argument("--source", action="append", help=f"{listed} (repeatable; default all)")
    m.add_argument("--cached", action="store_true", help="only names whose weights are in the local caches")
    m.set_defaults(func=run_models)
    f = sub.add_parser(
        "fetch-weights", help="download models into their libraries' caches ahead of time; --verify them offline"
    )
    f.add_argument("--model", action="append", help="as for extract (repeatable)")
    f.add_argument(
        "--weights",
        action="append",
        help="one per --model, in order (default: timm pretrained, torchvision DEFAULT, hf the repo's own)",
    )
    f.add_argument("--list", default=None, help="a file with 'MODEL [WEIGHTS]' per line")
    f.add_argument("--manifest", default=None, help="write what was fetched (revision, sha256 per file) to this JSON")
    f.add_argument("--force", action="store_true", help="fetch again cached files that fail their source's sha256")
    f.add_argument(
        "--verify",
        default=None,
        metavar="MANIFEST",
        help="offline: rebuild each entry from the caches and check its sha256",
    )
    f.set_defaults(func=run_fetch_weights)
