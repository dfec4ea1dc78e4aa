"""``featcache extract``."""

from __future__ import annotations

import argparse


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="timm model name, e.g. tf_efficientnet_lite0")
    p.add_argument(
        "--weights",
        default="timm",
        help="timm (local timm cache) | PATH (.pth/.pt/.safetensors) | package:NAME | random:SEED",
    )
    p.add_argument(
        "--data",
        required=True,
        help="digits | fashion-mnist[:DIR] | imagefolder:DIR | manifest:FILE (csv/parquet: path,label[,split][,id])",
    )
    p.add_argument("--split", action="append", dest="splits", help="split(s) to extract (repeatable; default: all)")
    p.add_argument("--cache", required=True, help="feature cache root (local path or fsspec URL)")
    p.add_argument("--dataset-name", help="dataset key in the store (default: derived from --data)")
    p.add_argument("--backbone-name", help="backbone key in the store (default: model name, NAME@random<SEED>, NAME@<ckpt stem>)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader decode workers (default: CPU max(1, cpus//4); CUDA min(8, cpus-1))")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default on CPU: cpus - workers, so they do not fight)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"], help="stored feature dtype")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute precision (auto: bf16 autocast on CUDA, fp32 on CPU)")
    p.add_argument("--no-channels-last", action="store_true", help="keep NCHW memory format")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward pass")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows per stored chunk (the unit of resume)")
    p.add_argument("--input-size", type=int, default=None, help="override the model's input resolution")
    p.add_argument("--pre-resize", type=int, default=None, help="resize to NxN before the pipeline (Salman et al.: 32)")
    p.add_argument("--features", type=_csv, default=["pooled"], help="pooled,tokens_mean,cls,stageN_avg (one forward)")
    p.add_argument("--limit", type=int, default=None, help="first N rows of each split only")
    p.add_argument("--overwrite", action="store_true", help="replace features stored with other settings")
    p.add_argument("--no-progress", action="store_true")
    from featcache.store.cli import add_storage_option_argument

    add_storage_option_argument(p)


def run_extract(args: argparse.Namespace) -> int:
    from featcache.extract.pipeline import DEFAULT_CHUNK_ROWS, extract
    from featcache.store.cli import parse_storage_options

    amp = {"auto": "auto", "fp32": "none", "bf16": "bf16", "fp16": "fp16"}[args.precision]
    reports = extract(
        args.model,
        args.weights,
        args.data,
        args.splits,
        args.cache,
        dataset_name=args.dataset_name,
        backbone_name=args.backbone_name,
        batch_size=args.batch_size,
        workers=args.workers,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        chunk_rows=args.chunk_rows or DEFAULT_CHUNK_ROWS,
        input_size=args.input_size,
        pre_resize=args.pre_resize,
        features=args.features,
        overwrite=args.overwrite,
        limit=args.limit,
        amp=amp,
        channels_last=not args.no_channels_last,
        compile=args.compile,
        progress=not args.no_progress,
        storage_options=parse_storage_options(args.storage_options),
    )
    from featcache.extract.pipeline import dist_info

    if dist_info()[0] != 0:
        return 0
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
    return 0


def register(sub) -> None:
    p = sub.add_parser("extract", help="run a backbone over a dataset into the feature cache")
    add_extract_arguments(p)
    p.set_defaults(func=run_extract)
