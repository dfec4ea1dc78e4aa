"""``featcache demo``'s command: flags into a :class:`~featcache.demo.run.DemoConfig`, the summary printed."""

from __future__ import annotations

import argparse

from featcache.demo.run import FMNIST_CPU_SIZE, FMNIST_TEST, FMNIST_TRAIN, PRETRAINED, DemoConfig, run
from featcache.errors import ConfigError

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 95


def run_demo(args: argparse.Namespace) -> int:
    """The CLI entry point: builds the config, runs, prints the summary."""
    if args.n_backbones is not None and not 1 <= args.n_backbones <= len(PRETRAINED):
        raise ConfigError(f"--n-backbones must be between 1 and {len(PRETRAINED)} (the random:0 baseline always runs)")
    cfg = DemoConfig(
        cache=args.cache,
        out=args.out,
        data=args.data,
        train_size=args.train_size,
        test_size=args.test_size,
        n_pretrained=args.n_backbones or len(PRETRAINED),
        batch_size=args.batch_size,
        workers=args.workers,
        threads=args.threads,
        input_size=args.input_size,
        finetune=args.finetune != "off",
        finetune_steps=args.finetune_steps,
        finetune_input_size=args.finetune_input_size,
        finetune_batch_size=args.finetune_batch_size,
        progress=not args.no_progress,
    )
    summary = run(cfg, say=print)
    print("summary:")
    for line in summary.lines():
        print(line)
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="extract, probe, retrieve, fine-tune and rank on Fashion-MNIST (or digits)")
    p.add_argument("--cache", default="featcache-demo.zarr")
    p.add_argument("--out", default="featcache-demo", help="folder for results, rankings, summary.json and the report")
    p.add_argument(
        "--data", default="auto", help="auto (Fashion-MNIST when installed, else digits), fashion-mnist[:DIR] or digits"
    )
    p.add_argument(
        "--train-size",
        type=int,
        default=None,
        help=f"first N train images (default {FMNIST_TRAIN} of Fashion-MNIST; all of digits)",
    )
    p.add_argument(
        "--test-size",
        type=int,
        default=None,
        help=f"first N test images (default {FMNIST_TEST} of Fashion-MNIST; all of digits)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: extract's choice; 1 when the machine is oversubscribed)",
    )
    p.add_argument(
        "--input-size",
        type=int,
        default=None,
        help=f"extraction resolution (default: the model's on CUDA, {FMNIST_CPU_SIZE} on CPU; 0 = the model's)",
    )
    p.add_argument(
        "--n-backbones",
        type=int,
        default=None,
        help="use only the first N pretrained backbones (the random:0 baseline always runs)",
    )
    p.add_argument(
        "--finetune",
        choices=["on", "off", "auto"],
        default="on",
        help="fine-tune every backbone (default on; on a CPU scaled down, recorded as scaled; auto = on)",
    )
    p.add_argument(
        "--finetune-steps",
        type=int,
        default=None,
        help="SGD steps of the VTAB lightweight schedule (default 500 on CUDA, 30 on CPU)",
    )
    p.add_argument(
        "--finetune-input-size",
        type=int,
        default=None,
        help="fine-tuning resolution (default: the model's on CUDA, 64 on CPU; 0 = the model's)",
    )
    p.add_argument("--finetune-batch-size", type=int, default=None, help="default 64 on CUDA, 32 on CPU")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_demo)
