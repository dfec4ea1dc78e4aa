"""The input sizes a backbone can take, checked before any image is read (``--input-size``).

A timm model with a fixed-size patch embedding (ViTs, Swin, ...: ``patch_embed.img_size`` with
``strict_img_size`` and no ``dynamic_img_size``) takes its ``img_size`` only; every other model
(a CNN takes any size above its minimum; a source that cannot tell) is tried with one blank
image of the configured size, and a forward that fails is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from featcache.errors import ConfigError, FeatcacheError

__all__ = ["check_input_size", "fixed_input_size"]

T = TypeVar("T")


def fixed_input_size(model: Any) -> tuple[int, int] | None:
    """The one (H, W) a model takes (timm's ``patch_embed.img_size`` when strict and not
    ``dynamic_img_size``), else None (any size its layers accept)."""
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    if size is None or getattr(model, "dynamic_img_size", False) or not getattr(pe, "strict_img_size", True):
        return None
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return int(h), int(w)


def _side(hw: tuple[int, ...]) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


def check_input_size(bb: Any, probe: Callable[[], T], *, asked: bool = True) -> T:
    """Refuse, in one line naming the sizes the model takes, an input size ``bb`` cannot take:
    against its fixed size where it has one, then by ``probe()`` (a forward of one blank image
    of that size, e.g. the feature head's dims probe, whose result is returned): with ``asked``
    (the user gave ``--input-size``) its failure is the refusal, else it raises as it is."""
    _, h, w = (int(s) for s in bb.data_config["input_size"])
    fixed = fixed_input_size(bb.model)
    if fixed is not None and fixed != (h, w):
        raise ConfigError(
            f"--input-size {_side((h, w))} is invalid: {bb.name} takes {_side(fixed)} x {_side(fixed)} images only "
            "(its patch embedding is built for that size: timm's patch_embed.img_size, without dynamic_img_size); "
            f"give --input-size {_side(fixed)} or leave it out"
        )
    if not asked:
        return probe()
    try:
        return probe()
    except FeatcacheError:
        raise  # the feature kinds' own one-line refusals
    except (RuntimeError, AssertionError, ValueError, IndexError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        default = (getattr(bb.model, "pretrained_cfg", None) or {}).get("input_size")
        hint = f" (its default: {default[-1]})" if default else ""
        raise ConfigError(
            f"--input-size {_side((h, w))} is invalid: {bb.name} cannot take {h} x {w} images ({why}); "
            f"a CNN takes any size above its minimum: give a larger --input-size{hint}"
        ) from None
