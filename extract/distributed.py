"""torchrun plumbing for the extraction: ranks, the process group, per-rank devices and
checked barriers (:func:`agree`) so a failure on any rank stops every rank with its message."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from featcache import errors
from featcache.errors import FeatcacheError

log = logging.getLogger(__name__)


def dist_info() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (1 process when unset)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_dist(device: str) -> tuple[int, int, bool]:
    """(rank, world size, whether this call created the process group)."""
    import torch.distributed as dist

    rank, world = dist_info()
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
        log.info("rank %d/%d joined (%s)", rank, world, backend)
        return rank, world, True
    return rank, world, False


def close_dist(created: bool) -> None:
    """Destroy the process group :func:`init_dist` created. Exiting with a live gloo group
    sometimes aborts at interpreter exit ("terminate called without an active exception",
    SIGABRT), which torchrun reports as a failed job although all work was done."""
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()


def rank_device(device: str) -> str:
    """Under torchrun each local rank takes its own GPU (``cuda:LOCAL_RANK``)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None or device not in ("auto", "cuda"):
        return device
    import torch

    if not torch.cuda.is_available():
        return device
    idx = int(local) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def agree(world: int, rank: int, what: str, fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on this rank (``None``: nothing to do here), then a barrier
    at which every rank learns whether all succeeded.

    After it, the ranks exchange error summaries (``all_gather_object``, itself a barrier): a rank
    whose ``fn`` raised re-raises its own exception, and every other rank raises the same
    :mod:`featcache.errors` class (else :class:`FeatcacheError`) naming the failing rank and
    repeating its message, instead of waiting in a barrier until the job times out. With one
    process this is just ``fn()``.
    """
    if world == 1:
        return fn(*args, **kwargs) if fn is not None else None
    import torch.distributed as dist

    result = error = summary = None
    try:
        result = fn(*args, **kwargs) if fn is not None else None
    except Exception as exc:  # reported to every rank, then re-raised below
        error = exc
        summary = (type(exc).__name__, str(exc))
    parts: list = [None] * world
    dist.all_gather_object(parts, summary)
    if error is not None:
        raise error
    failed = [(r, s) for r, s in enumerate(parts) if s is not None]
    if failed:
        r, (name, msg) = failed[0]
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, FeatcacheError)):
            cls, msg = FeatcacheError, f"{name}: {msg}"
        more = f" (ranks {', '.join(str(o) for o, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
        text = f"rank {r} failed during {what}{more}: {msg}; fix that and re-run the same command"
        try:
            exc = cls(text)
        except Exception:  # an error class with another constructor signature
            exc = FeatcacheError(text)
        raise exc from None
    return result


def gather(world: int, value: Any) -> list[Any]:
    """Every rank's ``value`` (``[value]`` with one process)."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    parts: list = [None] * world
    dist.all_gather_object(parts, value)
    return parts
