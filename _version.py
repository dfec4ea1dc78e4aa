"""The package's version, in a module of its own: every module below the root reads it from here
(``from featcache._version import __version__``), never from the package ``featcache`` itself."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
