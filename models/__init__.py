"""The models layer: model sources, backbones, weights and the catalog, below every stage.

>>> from featcache.models import create_backbone  # doctest: +SKIP

``create_backbone`` (the model factory: ``--model`` and ``--weights`` to a
:class:`~featcache.models.model.Backbone`), ``model_help`` and ``weights_help`` (the
``--model`` / ``--weights`` help built from the model- and weight-source registries) are what
the stages use: extraction, fine-tuning and the text/caption embeddings build their backbones
here. Modules: :mod:`~featcache.models.sources` (the model-source registry and its built-in
sources), :mod:`~featcache.models.backbones`, :mod:`~featcache.models.weights`,
:mod:`~featcache.models.catalog` (``featcache models``) and :mod:`~featcache.models.model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.models.backbones import create_backbone, weights_help
    from featcache.models.model import RESIZE_MODES, resize_help
    from featcache.models.sources import model_help

__all__ = ["RESIZE_MODES", "create_backbone", "model_help", "resize_help", "weights_help"]

#: imported on first use so ``--help`` imports no torch/timm stack
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "create_backbone": "featcache.models.backbones",
        "model_help": "featcache.models.sources",
        "weights_help": "featcache.models.backbones",
        "RESIZE_MODES": "featcache.models.model",
        "resize_help": "featcache.models.model",
    },
)
