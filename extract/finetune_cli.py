"""``featcache finetune``: fine-tune a backbone + linear head, write ``kind="finetune"`` rows."""

from __future__ import annotations

import argparse

PROTOCOL_CHOICES = ("vtab1k-light", "full")


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _limit(s: str) -> int | dict[str, int]:
    """``N`` (every split) or ``SPLIT=N[,SPLIT=N]``."""
    try:
        if "=" not in s:
            return int(s)
        out = {}
        for part in s.split(","):
            k, _, v = part.partition("=")
            out[k.strip()] = int(v)
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit takes N or SPLIT=N[,SPLIT=N], got {s!r}") from None


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="timm model name, e.g. tf_efficientnet_lite0")
    p.add_argument("--weights", default="timm",
                   help="timm (local cache) | PATH (.pth/.pt/.safetensors) | package:NAME | random:SEED")
    p.add_argument("--data", required=True,
                   help="digits | fashion-mnist[:DIR] | imagefolder:DIR | manifest:FILE")
    p.add_argument("--protocol", default="vtab1k-light", choices=PROTOCOL_CHOICES,
                   help="vtab1k-light: 1000 examples (800/200 selection), rows pair with probe "
                        "protocol vtab1k; full: all of train, pairs with probe protocol full")
    p.add_argument("--seeds", type=_ints, default=None,
                   help="comma-separated seeds (default 0,1,2 for vtab1k-light, 0 for full)")
    p.add_argument("--results", required=True, help="results parquet to append to")
    p.add_argument("--steps", type=_ints, default=[2500, 10000],
                   help="schedule lengths searched (VTAB: 2500,10000; fewer = scaled-down run)")
    p.add_argument("--lrs", type=_floats, default=[0.1, 0.01], help="learning rates searched (VTAB: 0.1,0.01)")
    p.add_argument("--batch-size", type=int, default=512, help="SGD batch (VTAB: 512)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="gradient-accumulation chunk when a full batch does not fit in memory")
    p.add_argument("--last-decay", type=float, default=0.9,
                   help="fraction of the steps at which the third lr/10 drop happens (paper: 'shortly before the end')")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="0 for fine-tuning (VTAB); VTAB's from-scratch runs use 0.01 x lr")
    p.add_argument("--input-size", type=int, default=None, help="override the model's input resolution")
    p.add_argument("--pre-resize", type=int, default=None, help="resize to NxN before the pipeline (Salman et al.: 32)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    p.add_argument("--eval-split", action="append", dest="eval_splits",
                   help="split(s) to test on (repeatable; default test)")
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val")
    p.add_argument("--val-source", default="split-800-200", choices=["split-800-200", "official-val"],
                   help="vtab1k-light selection data: the 200 held out of the 1000, or the dataset's val split")
    p.add_argument("--dataset-name", help="dataset key written to the rows (default: derived from --data; "
                   "must match the probe rows' dataset to pair)")
    p.add_argument("--backbone-name", help="backbone key written to the rows (default as extract: NAME, "
                   "NAME@random<SEED>, NAME@<ckpt stem>)")
    p.add_argument("--limit", type=_limit, default=None, help="first N rows of every split, or SPLIT=N[,SPLIT=N]")
    p.add_argument("--checkpoint-dir", default=None, help="default: RESULTS.finetune-ckpt")
    p.add_argument("--checkpoint-every", type=int, default=250, help="steps between checkpoints")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: min(4, cpus))")
    p.add_argument("--memory-limit-gb", type=float, default=4.0,
                   help="preprocess images once into memory up to this size, else stream them")
    p.add_argument("--force", action="store_true", help="rerun seeds already in the results table")
    p.add_argument("--no-progress", action="store_true")


def run_finetune(args: argparse.Namespace) -> int:
    import json
    import os

    from featcache.extract.finetune import finetune
    from featcache.results import check_results_path

    check_results_path(args.results)  # a bad --results fails before any compute

    workers = args.workers if args.workers is not None else min(4, os.cpu_count() or 1)
    out = finetune(
        args.model, args.weights, args.data, args.protocol, args.seeds, args.results,
        steps=args.steps, lrs=args.lrs, batch_size=args.batch_size, micro_batch=args.micro_batch,
        last_decay=args.last_decay, momentum=args.momentum, weight_decay=args.weight_decay,
        input_size=args.input_size, pre_resize=args.pre_resize, device=args.device,
        precision=args.precision, eval_splits=args.eval_splits or ["test"],
        train_split=args.train_split, val_split=args.val_split, val_source=args.val_source,
        dataset_name=args.dataset_name, backbone_name=args.backbone_name, limit=args.limit,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        workers=workers, memory_limit_gb=args.memory_limit_gb, force=args.force,
        progress=not args.no_progress,
    )
    top = out.filter(out["metric"] == "top1").sort(["eval_split", "seed"])
    print(f"{'backbone':<28} {'dataset':<20} {'protocol':<9} {'split':<8} {'seed':>4} "
          f"{'top1':>7} {'lr':>7} {'steps':>6}")
    for r in top.iter_rows(named=True):
        hp = json.loads(r["hparams"])
        lr = hp.get("lr")
        steps = hp.get("steps")
        seed = "med" if r["seed"] < 0 else str(r["seed"])
        print(f"{r['backbone']:<28} {r['dataset']:<20} {r['protocol']:<9} {r['eval_split']:<8} "
              f"{seed:>4} {r['value']:>7.4f} {lr if lr is not None else '':>7} "
              f"{steps if steps is not None and not isinstance(steps, list) else '':>6}")
    print(f"{out.height} row(s) in {args.results}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a backbone + linear head (VTAB lightweight protocol)")
    add_finetune_arguments(p)
    p.set_defaults(func=run_finetune)
