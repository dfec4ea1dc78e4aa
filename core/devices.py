"""Where and in which precision a stage computes: one resolution of ``--device`` and
``--precision`` for every stage that runs torch (extraction, fine-tuning).

Precision words: ``fp32``, ``bf16`` (autocast) and ``fp16`` (autocast, CUDA only); ``none`` is
accepted as ``fp32`` (the extract stage's record of it, ``amp="none"`` in the provenance).
"""

from __future__ import annotations

import logging

from featcache.errors import BackendUnavailableError, ConfigError, PrecisionUnavailableError

log = logging.getLogger(__name__)

__all__ = ["PRECISIONS", "PRECISION_ALIASES", "resolve_device", "resolve_precision"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
#: older spellings still accepted
PRECISION_ALIASES = {"none": "fp32"}


def resolve_device(device: str, *, cpu_note: str = "no CUDA device; runs on CPU", logger: logging.Logger = log) -> str:
    """``auto``: ``cuda`` where CUDA is available, else ``cpu`` (``cpu_note`` logged by
    ``logger``); a CUDA device where there is none is refused."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        logger.info(cpu_note)
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"device={device!r} requested but CUDA is not available; use --device cpu or auto "
            "(Python: device='cpu' or 'auto')"
        )
    return str(device)


def resolve_precision(
    precision: str,
    device: str,
    *,
    choices: tuple[str, ...] = PRECISIONS,
    python_name: str = "precision",
    logger: logging.Logger = log,
) -> str:
    """The precision ``device`` actually computes in: ``fp32``, ``bf16`` or ``fp16``.

    ``auto`` is bf16 on CUDA and fp32 on CPU (measured: docs/benchmarks.md, "bf16 on CPU").
    ``bf16`` on a CPU autocasts where the CPU has bf16 hardware (avx512_bf16 / AMX: one log
    line says which) and is refused, with the reason, where it has none. ``fp16`` (and bf16 on
    a device that is neither CUDA nor a CPU) is logged and computed as fp32. ``choices``: the
    words the stage accepts; ``python_name``: its config field, named in errors."""
    p = PRECISION_ALIASES.get(precision, precision)
    if p not in choices:
        ok = list(choices)
        raise ConfigError(
            f"--precision {p} is invalid (Python: {python_name}=): choose {', '.join(ok[:-1])} or {ok[-1]}"
        )
    if p == "auto":
        p = "bf16" if device.startswith("cuda") else "fp32"
    if device.startswith("cuda") or p == "fp32":
        return p
    if p == "fp16" or not device.startswith("cpu"):
        logger.warning("--precision %s applies on CUDA only; %s computes (and records) fp32", p, device)
        return "fp32"
    from featcache.core.cpu import bf16_support, cpu_isa

    ok_bf16, why = bf16_support()
    if not ok_bf16:
        raise PrecisionUnavailableError(
            f"--precision bf16 on {device}: {why}; use --precision fp32 (Python: {python_name}='fp32') or a CUDA device"
        )
    logger.info("bf16 autocast on %s: %s, ISA %s", device, why, cpu_isa())
    return p
