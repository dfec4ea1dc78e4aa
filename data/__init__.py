"""The data layer: image readers, decoding and preprocessing, below every stage.

>>> from featcache.data import open_dataset  # doctest: +SKIP

``open_dataset`` (a :class:`SplitSource` per split), ``default_name`` and ``split_transform``
serve every stage that reads images (extraction, and fine-tuning, which keeps them as uint8);
``detect_spec`` the suites (the data spec of a task folder); ``register_format`` and
``format_help`` a new data format and the ``--data`` help that lists every registered one
(:mod:`featcache.data.readers`). Modules: :mod:`~featcache.data.readers`,
:mod:`~featcache.data.source`, :mod:`~featcache.data.decode`, :mod:`~featcache.data.preprocess`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.data.preprocess import split_transform
    from featcache.data.readers import (
        default_name,
        detect_spec,
        format_help,
        official_val,
        open_dataset,
        register_format,
    )
    from featcache.data.source import SplitSource

__all__ = [
    "SplitSource",
    "default_name",
    "detect_spec",
    "format_help",
    "official_val",
    "open_dataset",
    "register_format",
    "split_transform",
]

#: imported on first use so ``--help`` imports no numpy/PIL stack
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "default_name": "featcache.data.readers",
        "detect_spec": "featcache.data.readers",
        "format_help": "featcache.data.readers",
        "official_val": "featcache.data.readers",
        "open_dataset": "featcache.data.readers",
        "register_format": "featcache.data.readers",
        "split_transform": "featcache.data.preprocess",
        "SplitSource": "featcache.data.source",
    },
)
