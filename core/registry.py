"""One registry for every name a user types: protocols, solvers, metrics, data formats, model
and weight sources, stages, commands (timm's ``register_model`` shape, one implementation)::

    SOLVERS: Registry[Solver] = Registry("probe solver", ProtocolError)

    @SOLVERS.register("lbfgs", note="scikit-learn's L-BFGS")
    def lbfgs(request): ...

    SOLVERS.register("elevater", "featcache.probes.elevater:fit")  # imported on first use
    SOLVERS["lbfgs"], list(SOLVERS), SOLVERS.help()

A name taken by another object is refused (the same object, or the same ``module:attr``, again
is harmless unless the registry is made with ``idempotent=False``); an unknown name gets one
line with the close matches and the known names. The registry imports none of its members: a
lazy entry's module is imported when the entry is first looked up, so help texts built from
usages import nothing.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar, overload

from featcache.errors import ConfigError, FeatcacheError, UsageError

__all__ = ["Entry", "Registry"]

T = TypeVar("T")

#: the default refusal of a taken name (``{kind}``, ``{name}``, ``{by}`` and ``{prev}`` are filled in)
DUPLICATE = "{kind} {name!r} is already registered (by {by}); register yours under another name"


def _where(obj: Any) -> str:
    """``module.qualname`` of a function or class, else its repr (for the duplicate message)."""
    if isinstance(obj, str):
        return obj
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{mod}.{qual}" if mod and qual else repr(obj)


class Entry(Generic[T]):
    """One registered name: its object (or the ``module:attr`` it is imported from on first
    use, kept as ``spec``), how help texts and errors name it (``usage``, ``note``), its
    ``aliases`` and ``info``, what the registry's owner records beside it (e.g. a metric's
    direction), readable without importing the object."""

    __slots__ = ("_obj", "aliases", "info", "name", "note", "spec", "usage")

    def __init__(
        self, name: str, target: T | str, usage: str, note: str = "", aliases: tuple[str, ...] = (), info: Any = None
    ):
        self.name, self.usage, self.note, self.aliases, self.info = name, usage, note, aliases, info
        self.spec: str | None = target if isinstance(target, str) else None
        self._obj: Any = target

    @property
    def target(self) -> Any:
        """The object, or its ``module:attr`` while it is not yet imported (never imports)."""
        return self._obj

    @property
    def loaded(self) -> bool:
        """Whether the object is at hand (registered directly, or its module imported)."""
        return self.spec is None or self._obj is not self.spec

    def load(self) -> T:
        """The registered object, importing a lazy entry's module the first time."""
        if not self.loaded:
            module, _, attr = self._obj.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._obj = obj
        return self._obj

    def help(self) -> str:
        """``usage (note)``, or the usage alone."""
        return f"{self.usage} ({self.note})" if self.note else self.usage

    def __repr__(self) -> str:
        return f"Entry({self.name!r}, {_where(self.spec or self._obj)})"


class Registry(MutableMapping[str, T], Generic[T]):
    """Names -> registered objects, in registration order.

    ``kind`` names a member in messages (``"data format"``); ``error`` is the
    :class:`~featcache.errors.FeatcacheError` subclass raised for a taken or unknown name;
    ``duplicate`` is the refusal's text (``{kind}``, ``{name}``, ``{by}``: where the member
    taken is defined, ``{prev}``: that member); ``key(member)`` says what makes two members
    the same (default: the member itself; e.g. a dataclass's function); ``idempotent``:
    registering the same member again is a no-op (else refused like any other).

    A mapping: ``reg[name]`` (aliases too) gives the object, ``list(reg)`` the names without
    aliases, ``reg.entry(name)`` the usage and note without importing anything; ``reg[name] =
    member`` replaces a member outright, keeping its usage (for a test that swaps one in, as
    ``monkeypatch.setitem`` does), ``del reg[name]`` removes it."""

    def __init__(
        self,
        kind: str,
        error: type[FeatcacheError] = ConfigError,
        *,
        duplicate: str = DUPLICATE,
        key: Callable[[T], Any] | None = None,
        idempotent: bool = True,
    ):
        if not (isinstance(error, type) and issubclass(error, FeatcacheError)):
            raise UsageError(f"Registry error must be a FeatcacheError subclass, got {error!r}")
        self.kind, self.error, self.duplicate = kind, error, duplicate
        self._key: Callable[[T], Any] = key or (lambda obj: obj)
        self.idempotent = idempotent
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}  # alias -> name

    # ------------------------------------------------------------------ registering
    @overload
    def register(
        self,
        name: str,
        target: None = None,
        *,
        usage: str | None = ...,
        note: str = ...,
        aliases: tuple[str, ...] = ...,
        info: Any = ...,
    ) -> Callable[[T], T]: ...
    @overload
    def register(
        self,
        name: str,
        target: T | str,
        *,
        usage: str | None = ...,
        note: str = ...,
        aliases: tuple[str, ...] = ...,
        info: Any = ...,
    ) -> T | str: ...
    def register(
        self,
        name: str,
        target: T | str | None = None,
        *,
        usage: str | None = None,
        note: str = "",
        aliases: tuple[str, ...] = (),
        info: Any = None,
    ) -> Any:
        """Register ``target`` as ``name`` (also reachable as each of ``aliases``).

        Without ``target``, a decorator; a ``str`` target is ``"module:attr"``, imported on first
        lookup. ``usage``: how help texts and errors name it (default ``name``); ``note``: a
        short gloss in the help; ``info``: kept on the entry. A name or alias taken by another
        object is refused with ``error``; the same object (or ``module:attr``) again is a no-op
        when the registry is ``idempotent``."""
        if target is None:

            def deco(obj: T) -> T:
                self.register(name, obj, usage=usage, note=note, aliases=aliases, info=info)
                return obj

            return deco
        if isinstance(target, str) and ":" not in target:
            raise self.error(f"a lazy {self.kind} is registered as 'module:attr', got {target!r} for {name!r}")
        for key in (name, *aliases):
            prev = self._find(key)
            if prev is not None and not (self.idempotent and self._same(prev, target)):
                raise self.error(self._refusal(key, prev))
        if name not in self._entries:
            self._entries[name] = Entry(name, target, usage or name, note, tuple(aliases), info)
            for a in aliases:
                self._aliases.setdefault(a, name)
        return target

    def _same(self, prev: Entry[T], target: Any) -> bool:
        """Whether ``target`` is what ``prev`` holds (the same ``module:attr``, or the same member)."""
        if isinstance(target, str) or not prev.loaded:
            return target == prev.spec
        obj = prev.target
        return obj is target or (type(obj) is type(target) and self._key(obj) == self._key(target))

    def _refusal(self, name: str, prev: Entry[T]) -> str:
        by = prev.spec or _where(self._key(prev.target))
        return self.duplicate.format(kind=self.kind, name=name, by=by, prev=prev.target)

    def unregister(self, name: str) -> Entry[T]:
        """Remove ``name`` (and its aliases); its entry (a plug-in's or a test's undo)."""
        entry = self._entries.pop(self._aliases.get(name, name))
        for a in entry.aliases:
            self._aliases.pop(a, None)
        return entry

    def copy(self) -> Registry[T]:
        """A registry of the same kind with the same entries (registering in one leaves the other)."""
        new: Registry[T] = Registry(self.kind, self.error, duplicate=self.duplicate, idempotent=self.idempotent)
        new._key, new._entries, new._aliases = self._key, dict(self._entries), dict(self._aliases)
        return new

    @contextlib.contextmanager
    def restored(self) -> Iterator[Registry[T]]:
        """A block after which the registry is as it was before (what a test registers is undone)."""
        entries, aliases = dict(self._entries), dict(self._aliases)
        try:
            yield self
        finally:
            self._entries, self._aliases = entries, aliases

    # ------------------------------------------------------------------ looking up
    def _find(self, name: str) -> Entry[T] | None:
        return self._entries.get(self._aliases.get(name, name))

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name`` or an alias (nothing imported); unknown: :meth:`unknown`'s error."""
        found = self._find(name)
        if found is None:
            raise self.error(self.unknown(name))
        return found

    def get_entry(self, name: str) -> Entry[T] | None:
        """The entry of ``name`` or an alias, or ``None`` (nothing imported)."""
        return self._find(name)

    def __getitem__(self, name: str) -> T:
        found = self._find(name)
        if found is None:
            raise KeyError(name)
        return found.load()

    def __setitem__(self, name: str, member: T) -> None:
        prev = self._find(name)
        if prev is None:
            self._entries[name] = Entry(name, member, name)
        else:
            self._entries[prev.name] = Entry(prev.name, member, prev.usage, prev.note, prev.aliases, prev.info)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.unregister(name)

    def resolve(self, name: str) -> T:
        """The object registered as ``name`` (or an alias); unknown: ``error`` with the close matches."""
        return self.entry(name).load()

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry[T]]:
        """Every entry once, in registration order."""
        return list(self._entries.values())

    def names(self, *, aliases: bool = False) -> list[str]:
        """The registered names in registration order (then the aliases, with ``aliases``)."""
        return [*self._entries, *(self._aliases if aliases else ())]

    # ------------------------------------------------------------------ help and errors
    def usages(self) -> list[str]:
        """How the help names each entry, in registration order."""
        return [e.usage for e in self._entries.values()]

    def help(self, sep: str = " | ") -> str:
        """Every entry's ``usage (note)`` in registration order, ``sep``-separated."""
        return sep.join(e.help() for e in self._entries.values())

    def close_matches(self, name: str, n: int = 3, cutoff: float = 0.6) -> list[str]:
        """The registered names and aliases closest to ``name`` (difflib), best first."""
        return difflib.get_close_matches(str(name), self.names(aliases=True), n=n, cutoff=cutoff)

    def unknown(
        self,
        name: str,
        *,
        spec: str | None = None,
        what: str | None = None,
        known: str = "known:",
        listing: str | None = None,
    ) -> str:
        """One line for an unknown ``name``: ``unknown KIND 'fulll'; did you mean 'full'?
        known: a, b:N, ...`` (``spec``: the text quoted, when the user typed more than the name;
        ``what`` replaces ``unknown KIND``; ``known`` labels the list, ``listing`` replaces the
        usages listed)."""
        close = self.close_matches(name)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        shown = name if spec is None else spec
        listed = ", ".join(self.usages()) if listing is None else listing
        return f"{what or f'unknown {self.kind}'} {shown!r}; {hint}{known} {listed}"

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"
