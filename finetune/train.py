"""The fine-tuning loop: backbone + linear head as one module, SGD training runs with
atomic checkpoints and resume, and softmax prediction; device and precision resolution."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core import devices
from featcache.finetune.data import Pool
from featcache.finetune.schedule import TrainConfig, batch_positions, lr_at

if TYPE_CHECKING:
    import torch

__all__ = [
    "Net",
    "TrainResult",
    "atomic_json",
    "eval_batch_size",
    "key_hash",
    "predict_proba",
    "resolve_device",
    "resolve_precision",
    "train_run",
]

log = logging.getLogger(__name__)


class Net:
    """Backbone (pooled features) + linear head as one torch module (built lazily)."""

    @staticmethod
    def build(
        backbone_model: torch.nn.Module,
        feature_dim: int,
        n_classes: int,
        embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.nn.Module:
        """``embed(x)``: the pooled features of a batch (a non-timm source's own forward, e.g.
        open_clip's ``encode_image``); ``None``: the model's output (timm, ``num_classes=0``)."""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.backbone = backbone_model
                self.head = torch.nn.Linear(feature_dim, n_classes)
                torch.nn.init.zeros_(self.head.weight)
                torch.nn.init.zeros_(self.head.bias)

            def forward(self, x):
                return self.head(self.backbone(x) if embed is None else embed(x))

        return Net()


#: the words ``--precision`` takes for fine-tuning (fp16 is not offered)
PRECISIONS = ("auto", "fp32", "bf16")


def resolve_device(device: str) -> str:
    """The device fine-tuning runs on (:func:`featcache.core.devices.resolve_device`)."""
    note = "no CUDA device: fine-tuning runs on CPU (fp32); use a scaled-down schedule"
    return devices.resolve_device(device, cpu_note=note, logger=log)


def resolve_precision(precision: str, device: str) -> str:
    """``auto``: bf16 autocast on CUDA, fp32 on CPU. ``bf16`` on a CPU runs where the CPU has
    bf16 hardware (avx512_bf16 / AMX; one log line) and is refused, with the reason, elsewhere
    (:func:`featcache.core.devices.resolve_precision`)."""
    return devices.resolve_precision(precision, device, choices=PRECISIONS, logger=log)


def _autocast(device: str, precision: str):
    import contextlib

    import torch

    if precision == "bf16":
        return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ checkpoints
def _atomic_torch_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_json(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass
class TrainResult:
    net: Any
    finite: bool
    seconds: float
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)


def train_run(
    net: torch.nn.Module,
    init_state: dict,
    pool: Pool,
    positions: np.ndarray,
    cfg: TrainConfig,
    *,
    seed: int,
    device: str,
    precision: str,
    ckpt_path: Path | None,
    checkpoint_every: int,
    run_key: dict,
    progress: bool = True,
    desc: str = "finetune",
) -> TrainResult:
    """Fine-tune ``net`` (reset to ``init_state``) on pool rows ``positions`` with ``cfg``.

    Resumes from ``ckpt_path`` when it holds a checkpoint of the same ``run_key``.
    """
    import torch

    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG state is left untouched
        return _train_run(
            net,
            init_state,
            pool,
            positions,
            cfg,
            seed=seed,
            device=device,
            precision=precision,
            ckpt_path=ckpt_path,
            checkpoint_every=checkpoint_every,
            run_key=run_key,
            progress=progress,
            desc=desc,
        )


def _train_run(
    net,
    init_state,
    pool,
    positions,
    cfg,
    *,
    seed,
    device,
    precision,
    ckpt_path,
    checkpoint_every,
    run_key,
    progress,
    desc,
) -> TrainResult:
    import torch

    from featcache.core.progress import tqdm

    t0 = time.perf_counter()
    net.load_state_dict(init_state)
    net.to(device)
    if device.startswith("cuda"):
        net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    torch.manual_seed(
        int(hashlib.sha256(json.dumps(run_key, sort_keys=True, default=str).encode()).hexdigest()[:8], 16)
    )
    start, finite, resumed, losses = _resume(net, opt, ckpt_path, run_key, device, desc, cfg.steps)

    def save(step: int) -> None:
        if ckpt_path is None:
            return
        _atomic_torch_save(
            {
                "key": run_key,
                "step": step,
                "finite": finite,
                "model": net.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "losses": losses,
                "cuda_rng": torch.cuda.get_rng_state() if device.startswith("cuda") else None,
            },
            ckpt_path,
        )
        log.info("checkpoint saved: %s step %d/%d -> %s", desc, step, cfg.steps, ckpt_path)

    n = positions.size
    B = cfg.batch_size
    mb = cfg.micro_batch or B
    net.train()  # BatchNorm statistics update during fine-tuning
    bar = tqdm(total=cfg.steps, initial=start, desc=desc, disable=not progress)
    step = start
    while step < cfg.steps and finite:
        stop = cfg.steps if ckpt_path is None else min(cfg.steps, (step // checkpoint_every + 1) * checkpoint_every)
        idx_lists = [positions[batch_positions(n, B, seed, s)] for s in range(step, stop)]
        chunks = [c for idx in idx_lists for c in np.array_split(idx, math.ceil(B / mb))]
        it = pool.batches(chunks, device)
        for s in range(step, stop):
            for g in opt.param_groups:
                g["lr"] = lr_at(s, cfg.lr, cfg.milestones)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(math.ceil(B / mb)):
                x, y = next(it)
                if device.startswith("cuda"):
                    x = x.contiguous(memory_format=torch.channels_last)
                y = y.to(device, non_blocking=True)
                with _autocast(device, precision):
                    logits = net(x)
                loss = torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum") / B
                loss.backward()
                total += float(loss.detach())
            if not math.isfinite(total):
                finite = False
                log.warning("%s diverged at step %d (lr=%g): loss %s", desc, s, cfg.lr, total)
                step = s + 1
                break
            opt.step()
            losses.append(total)
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", refresh=False)
            step = s + 1
        if step < cfg.steps and finite:
            save(step)
    bar.close()
    save(step)  # end of training: a kill before the rows are written skips retraining
    return TrainResult(net, finite, time.perf_counter() - t0, resumed, losses)


def _resume(
    net, opt, ckpt_path: Path | None, run_key: dict, device: str, desc: str, steps: int
) -> tuple[int, bool, int | None, list[float]]:
    """Load ``ckpt_path`` into ``net``/``opt``/the RNGs when it holds a checkpoint of
    ``run_key``: (start step, finite, resumed-from step or None, losses so far)."""
    import torch

    start, finite, resumed = 0, True, None
    losses: list[float] = []
    if ckpt_path is not None and ckpt_path.exists():
        try:
            ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # unreadable leftovers: start over, never crash on them
            log.warning("ignoring unreadable checkpoint %s (%s); training from step 0", ckpt_path, exc)
            ck = None
        if ck is not None and ck.get("key") == run_key:
            net.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            torch.set_rng_state(ck["rng"])
            if device.startswith("cuda") and ck.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(ck["cuda_rng"])
            start, finite, resumed = int(ck["step"]), bool(ck["finite"]), int(ck["step"])
            losses = list(ck.get("losses", []))
            log.info("resuming %s from checkpoint %s at step %d/%d", desc, ckpt_path, start, steps)
        elif ck is not None:
            log.warning("checkpoint %s belongs to another run definition; training from step 0", ckpt_path)

    return start, finite, resumed, losses


#: evaluation batch (images), and on the CPU at most this many pixels per batch: 256 images up
#: to 112 px, 64 at 224 px (lite0's activations for 256 images at 224 px took 5.7 GB of RAM)
EVAL_BATCH = 256
CPU_EVAL_PIXELS = EVAL_BATCH * 112 * 112


def eval_batch_size(device: str, pixels: int) -> int:
    """Images per evaluation batch for images of ``pixels`` (H x W) on ``device``: bounds the
    CPU's host memory; a GPU keeps :data:`EVAL_BATCH`."""
    if device.startswith("cuda"):
        return EVAL_BATCH
    return max(1, min(EVAL_BATCH, CPU_EVAL_PIXELS // max(1, int(pixels))))


def predict_proba(
    net: torch.nn.Module,
    pool: Pool,
    positions: np.ndarray,
    *,
    device: str,
    precision: str,
    batch_size: int | None = None,
) -> np.ndarray:
    """Softmax probabilities ``[N, K]`` (float64) of ``net`` in eval mode, ``batch_size``
    images at a time (default :func:`eval_batch_size`)."""
    import torch

    if batch_size is None:
        batch_size = eval_batch_size(device, pool.pixels)
    net.eval()
    out = []
    chunks = [positions[i : i + batch_size] for i in range(0, positions.size, batch_size)]
    with torch.inference_mode():
        for x, _ in pool.batches(chunks, device):
            if device.startswith("cuda"):
                x = x.contiguous(memory_format=torch.channels_last)
            with _autocast(device, precision):
                logits = net(x)
            out.append(torch.softmax(logits.float(), dim=1).double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))
