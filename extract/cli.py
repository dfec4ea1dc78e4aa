"""``featcache extract``."""

from __future__ import annotations

import argparse


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`~featcache.extract.config.ExtractConfig` (its single source)."""
    from featcache.extract.config import ExtractConfig
    from featcache.store.cli import add_storage_option_argument

    ExtractConfig.add_arguments(p)
    add_storage_option_argument(p)


def run_extract(args: argparse.Namespace) -> int:
    """``featcache extract``: build the config, tune the CPU allocator (this command only;
    :mod:`featcache.allocator`), run the stage, print one line per split."""
    from featcache.extract.config import ExtractConfig
    from featcache.store.cli import parse_storage_options

    progress = getattr(args, "progress", True) and not getattr(args, "no_progress", False)  # -q: none
    cfg = ExtractConfig.from_args(args, storage_options=parse_storage_options(args.storage_options),
                                  progress=progress)
    if _runs_on_cpu(cfg.device):
        from featcache.allocator import tune_cpu_allocator

        tune_cpu_allocator()
    from featcache.extract.pipeline import extract

    reports = extract(cfg)
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


def _runs_on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def register(sub) -> None:
    p = sub.add_parser("extract", help="run a backbone over a dataset into the feature cache")
    add_extract_arguments(p)
    p.set_defaults(func=run_extract)
