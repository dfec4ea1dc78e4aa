"""Evaluation protocols (moving into a package: the module's text is ``plans`` for now)."""

from featcache.core.protocols import plans as _plans

globals().update({k: v for k, v in vars(_plans).items() if not k.startswith("__")})
__all__ = _plans.__all__
__doc__ = _plans.__doc__
