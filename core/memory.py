"""One parser for the memory bounds users type (``--max-memory 2GB``), shared by the stages."""

from __future__ import annotations

import re

from featcache.errors import ConfigError, FeatcacheError

__all__ = ["parse_memory"]

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*")
_EXAMPLE = "write e.g. 2GB, 512MB or 1e9"


def parse_memory(
    text: str | int | float | None,
    *,
    name: str = "--max-memory",
    error: type[FeatcacheError] = ConfigError,
    default: int | None = None,
) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1e9"``, ``1000000`` -> bytes, at least 1 MiB.

    ``None`` gives ``default`` when there is one; a text that is no size, an infinite size
    and one below 1 MiB raise ``error`` naming the value as ``name`` (the flag or the option)."""
    if text is None and default is not None:
        return default
    if isinstance(text, (int, float)):
        num = float(text)
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise error(f"{name} {text!r} is invalid: {_EXAMPLE}")
        base = 1024 if m.group(3) else 1000
        num = float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_")
    if not num - num == 0:  # inf (1e400) and NaN
        raise error(f"{name} {text!r} is not a finite size; {_EXAMPLE}")
    val = int(text) if isinstance(text, int) else int(num)
    if val < 1024**2:
        raise error(f"{name} {text!r} is below 1 MB; give at least a few hundred MB, e.g. 2GB")
    return val
