"""``featcache finetune``: fine-tune a backbone + linear head, write ``kind="finetune"`` rows.

Every flag comes from :class:`~featcache.finetune.config.FinetuneConfig`'s fields; the
command builds the config, tunes the CPU allocator for its own process (never a library
call's side effect) and calls :func:`featcache.finetune.runner.finetune`.
"""

from __future__ import annotations

import argparse

from featcache.configs import add_arguments, from_namespace
from featcache.finetune.config import FinetuneConfig


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p, FinetuneConfig)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """The :class:`FinetuneConfig` of parsed ``featcache finetune`` arguments."""
    progress = getattr(args, "progress", True) and not getattr(args, "no_progress", False)  # -q: none
    return from_namespace(FinetuneConfig, args, progress=progress)


def run_finetune(args: argparse.Namespace) -> int:
    import json

    from featcache.finetune.runner import finetune
    from featcache.results import check_results_path

    cfg = config_from_args(args)
    check_results_path(cfg.results_path)  # a bad --results fails before any compute
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # CPU training allocates the same large activations every step
        from featcache.allocator import tune_cpu_allocator

        tune_cpu_allocator()
    out = finetune(cfg)
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
    print(f"{out.height} row(s) in {cfg.results_path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a backbone + linear head (VTAB lightweight protocol)")
    add_finetune_arguments(p)
    p.set_defaults(func=run_finetune)
