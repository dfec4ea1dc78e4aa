"""What decides a feature's bits besides the backbone's identity: the precision the forward runs
in and the settings a resume compares. Below both the pipeline and ``--backend auto``
(:mod:`featcache.extract.auto`), which read them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from featcache.core.devices import resolve_precision

if TYPE_CHECKING:
    from featcache.store import FeatureProvenance

log = logging.getLogger(__name__)

__all__ = ["compute_settings", "recorded_precision"]


def recorded_precision(amp: str, device: str) -> str:
    """The precision the forward actually runs in, as the provenance records it (``amp``):
    ``none`` (fp32), ``bf16`` or ``fp16`` (:func:`featcache.core.devices.resolve_precision`)."""
    p = resolve_precision(amp, device, python_name="amp", logger=log)
    return "none" if p == "fp32" else p


def compute_settings(prov: FeatureProvenance) -> dict[str, Any]:
    """The settings besides the identity that decide a feature's bits: device kind, applied
    precision, CPU thread count and ISA, the decode settings and the forward backend (None:
    not recorded, e.g. an older store). A CPU store without a recorded ISA predates CPU autocast, so its precision
    is fp32 whatever it says."""
    device = prov.device.split(":")[0] if prov.device else None
    extra = prov.extra or {}
    cpu = device == "cpu"
    return {
        "device": device,
        "precision": "none" if cpu and "cpu_isa" not in extra else prov.amp,
        "threads": extra.get("threads") if cpu else None,
        "cpu_isa": extra.get("cpu_isa") if cpu else None,
        "exif_transpose": extra.get("exif_transpose"),
        "max_image_pixels": extra.get("max_image_pixels"),
        "decoder": extra.get("decoder"),
        "backend": extra.get("backend"),
    }
