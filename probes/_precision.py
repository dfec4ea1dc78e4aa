"""The probes' bf16 choice: autocast to bf16 only where the device computes it fast (CUDA; a
CPU whose flags show AMX, :func:`featcache.core.cpu.bf16_flags`, which ``FEATCACHE_CPU_BF16=0``
empties) **and** the heads' logits under bf16 agree with fp32 on a first batch (every row's
cosine at least ``bound``, the extract stage's bound). Else fp32. The record says which and why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["bf16_choice"]


def bf16_choice(device: str, logits: Callable[[], Any], bound: float) -> tuple[Any, dict[str, Any]]:
    """``(torch.bfloat16 or None, record)``: ``logits()`` (a ``[..., C]`` tensor of the fresh
    heads on one batch) is computed once in fp32 and once under bf16 autocast and compared row
    by row (cosine over the classes)."""
    import torch

    from featcache.core.cpu import bf16_flags

    if device.startswith("cuda"):
        why = "CUDA"
    elif "amx_bf16" in bf16_flags():
        why = "AMX (amx_bf16)"
    else:
        return None, {"precision": "fp32", "why": "no CUDA device and no AMX on this CPU"}
    with torch.no_grad():
        ref = logits().float()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            low = logits().float()
    cos = float(torch.nn.functional.cosine_similarity(ref, low, dim=-1).min())
    ok = cos >= bound
    rec = {"precision": "bf16" if ok else "fp32", "why": why, "cosine_min": round(cos, 6), "threshold": bound}
    return (torch.bfloat16 if ok else None), rec
