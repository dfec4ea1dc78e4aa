"""Stage configs as frozen dataclasses that are also the single source of their CLI flags.

A field's ``metadata`` (built with :func:`flag`) says how it appears on the command line;
:func:`add_arguments` adds one argparse argument per field and :func:`from_namespace`
builds the config from the parsed namespace. Library users build the config directly.

Only ``argparse`` and ``dataclasses`` are imported here, so a stage's CLI module stays
cheap to import (``featcache extract`` starts fast).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = [
    "Interval",
    "Matches",
    "OneOf",
    "add_arguments",
    "check_fields",
    "choices_of",
    "flag",
    "float_list",
    "from_namespace",
    "help_of",
    "int_list",
    "renamed_kwargs",
    "seed_tuple",
    "str_tuple",
]

_MISSING = dataclasses.MISSING
T = TypeVar("T")


class Interval:
    """A field constraint (as scikit-learn's ``Interval``): an instance of ``kind`` in
    ``[lo, hi]`` (``None``: unbounded; ``open_lo``: ``lo`` itself excluded); ``None`` passes
    (an optional field left unset). A ``float`` interval takes integers too, never NaN or
    infinity."""

    def __init__(
        self, kind: type, lo: float | None = None, hi: float | None = None, *, hi_text: str = "", open_lo: bool = False
    ) -> None:
        self.kind, self.lo, self.hi, self.hi_text, self.open_lo = kind, lo, hi, hi_text, open_lo

    def __call__(self, value: Any) -> str | None:
        """``None`` if ``value`` is allowed, else what is wanted instead."""
        if value is None:
            return None
        what = "an integer" if self.kind is int else "a finite number"
        kinds = (int, float) if self.kind is float else self.kind
        finite = not isinstance(value, float) or value - value == 0  # NaN and inf fail
        if not finite:
            return self.wanted()  # the whole range: NaN and inf are refused whatever the bounds
        if (
            isinstance(value, bool)
            or not isinstance(value, kinds)
            or not finite
            or (self.lo is not None and (value <= self.lo if self.open_lo else value < self.lo))
        ):
            return f"must be {what}" + (f" {'>' if self.open_lo else '>='} {self.lo}" if self.lo is not None else "")
        if self.hi is not None and value > self.hi:
            return self.hi_text or f"must be at most {self.hi}"
        return None

    def wanted(self) -> str:
        """The whole range in words (``must be a finite number > 0 and at most 1000``)."""
        what = "an integer" if self.kind is int else "a finite number"
        lo = f" {'>' if self.open_lo else '>='} {self.lo}" if self.lo is not None else ""
        return f"must be {what}{lo}" + (f" and at most {self.hi}" if self.hi is not None else "")

    shown = staticmethod(str)


class OneOf:
    """A field constraint: one of ``options`` (a flag with this check gets them as choices)."""

    def __init__(self, *options: Any) -> None:
        self.options = options

    def __call__(self, value: Any) -> str | None:
        if value in self.options:
            return None
        *head, last = map(str, self.options)
        return f"choose {', '.join(head)} or {last}" if head else f"choose {last}"

    shown = staticmethod(str)


class Matches:
    """A field constraint: a string matching ``pattern`` (``text`` says what is wanted)."""

    def __init__(self, pattern: re.Pattern, text: str) -> None:
        self.pattern, self.text = pattern, text

    def __call__(self, value: Any) -> str | None:
        return None if isinstance(value, str) and self.pattern.match(value) else self.text

    @staticmethod
    def shown(obj: object) -> str:
        return repr(obj)


def check_fields(config: Any) -> None:
    """Check every field declared with ``flag(check=...)``: a :class:`ConfigError` naming
    the flag (``--batch-size 0 is invalid: must be an integer >= 1``) on the first bad one."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        value = getattr(config, f.name)
        want = check(value) if check is not None else None
        if want and check is not None:
            from featcache.errors import ConfigError

            name = f.metadata["name"] or "--" + f.name.replace("_", "-")
            raise ConfigError(f"{name} {check.shown(value)} is invalid: {want}")


def flag(
    default: Any = _MISSING,
    help: str | Callable[[], str] | None = None,
    *,
    name: str | None = None,
    cli: bool = True,
    negate: str | None = None,
    required: bool = False,
    show_default: bool = True,
    check: Callable[[Any], str | None] | None = None,
    default_factory: Callable[[], Any] | None = None,
    **argparse_kw: Any,
) -> Any:
    """A dataclass field with its CLI description.

    ``name``: the flag (default ``--field-name``); ``cli=False``: not on the command line
    (the stage's CLI sets it by hand); ``negate``: a boolean field set to False by this
    store-true flag (e.g. ``--no-standardize``); ``required``: a required flag (the field
    then has no default, or its default is for library users only); ``show_default=False``:
    the help does not append ``(default: ...)`` (it says the default itself, or the flag is
    required); ``check``: the field's constraint (:class:`Interval`, :class:`OneOf`,
    :class:`Matches`), applied by :func:`check_fields`; a :class:`OneOf` gives the flag its
    choices; other keywords go to ``add_argument`` (``type``, ``choices``, ``action``,
    ``metavar``, ``dest`` is always the field name). ``help`` and ``choices`` may be
    callables, called each time a parser is built: a flag whose text or choices come from a
    registry (protocols, formats, model sources) shows what is registered then.
    """
    if isinstance(check, OneOf) and "choices" not in argparse_kw:
        argparse_kw["choices"] = list(check.options)
    meta = {
        "check": check,
        "help": help,
        "name": name,
        "cli": cli,
        "negate": negate,
        "required": required,
        "show_default": show_default,
        "argparse": argparse_kw,
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def help_of(f: dataclasses.Field) -> str | None:
    """A flagged field's help text now (a callable ``help`` is called: its registry as it is)."""
    h = f.metadata.get("help")
    return str(h()) if callable(h) else (None if h is None else str(h))


def choices_of(f: dataclasses.Field) -> list[Any] | None:
    """A flagged field's choices now (a callable ``choices`` is called), or None."""
    c = f.metadata.get("argparse", {}).get("choices")
    if c is None:
        return None
    made: Any = c() if callable(c) else c  # a registry's names, or the list itself
    return list(made)


def _cli_fields(cls):
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    optional: tuple[str, ...] = (),
    show_defaults: bool = True,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """One argparse argument per CLI field of dataclass ``cls``, defaulting to the field's
    default (repeatable flags are absent from the namespace unless given, so
    :func:`from_namespace` falls back to the field default): the dataclass holds the only
    copy of each default. Fields named in ``optional`` are not required on this parser
    (e.g. ``data`` when ``--suite`` names the data); ``show_defaults=False``: no help text
    gets ``(default: ...)`` appended; ``only``/``skip``: add just these fields / all but these
    (e.g. some fields' flags into an argument group)."""
    for f in _cli_fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        m = f.metadata
        help_ = (help_of(f) or "").replace("%", "%%") or None
        kw = dict(m["argparse"])
        if "choices" in kw:
            kw["choices"] = choices_of(f)
        shown = (
            show_defaults
            and m.get("show_default", True)
            and f.default is not _MISSING
            and f.default is not None
            and not isinstance(f.default, (bool, tuple))
        )
        if shown and kw.get("action") is None:
            help_ = f"{help_ or ''} (default: {str(f.default).replace('%', '%%')})".strip()
        if m["negate"]:
            parser.add_argument(m["negate"], dest=f.name, action="store_false", default=argparse.SUPPRESS, help=help_)
            continue
        name = m["name"] or "--" + f.name.replace("_", "-")
        if kw.get("type") in _NUMBERS and not (kw["type"] is float and isinstance(m["check"], Interval)):
            kw["type"] = _finite(kw["type"], m["check"])  # (a float Interval refuses NaN itself, in check_fields)
        if kw.get("action") not in ("store_true", "store_false") and "choices" not in kw:
            kw.setdefault("metavar", name.lstrip("-").replace("-", "_").upper())
        if kw.get("action") == "append" or f.default is _MISSING:
            kw.setdefault("default", argparse.SUPPRESS)  # appending to a default would keep it
        else:
            kw.setdefault("default", f.default)
        if m["required"] and f.name not in optional:
            kw["required"] = True
        parser.add_argument(name, dest=f.name, help=help_, **kw)


def _finite(cast: Callable[[str], Any], check: Callable[[Any], str | None] | None) -> Callable[[str], Any]:
    """argparse type: ``cast``'s number(s), NaN, infinity and overflow (``1e400``) refused at
    the boundary with the field's valid range (its :class:`Interval`), in one line. A float
    field with an Interval is left to it (``check_fields``: the same words, exit 1)."""

    def parse(text: str) -> Any:
        want = check.wanted() if isinstance(check, Interval) else "must be a finite number"
        try:
            got = cast(text)
        except (ValueError, OverflowError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {want}") from None
        if any(isinstance(v, float) and not v - v == 0 for v in (got if isinstance(got, list) else [got])):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {want}")
        return got

    parse.__name__ = getattr(cast, "__name__", "number")  # argparse names the type in its messages
    return parse


def from_namespace(cls: type[T], ns: argparse.Namespace, **extra: Any) -> T:
    """Build ``cls`` from parsed arguments: every CLI field present in ``ns`` plus
    ``extra`` (fields the stage's CLI derives itself); absent ones keep their defaults."""
    kw = {f.name: getattr(ns, f.name) for f in _cli_fields(cls) if hasattr(ns, f.name)}
    kw.update(extra)
    return cls(**kw)


def renamed_kwargs(**old_to_new: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: the dataclass's ``__init__`` still accepts each old keyword, with a
    DeprecationWarning naming the new one (``@renamed_kwargs(results="results_path")``)."""
    import functools
    import warnings

    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            for old, new in old_to_new.items():
                if old in kw:
                    if new in kw:
                        from featcache.errors import UsageError

                        raise UsageError(
                            f"{cls.__name__}() got both {old}= and {new}=; {old}= is deprecated, use {new}="
                        )
                    warnings.warn(
                        f"{cls.__name__}({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=2
                    )
                    kw[new] = kw.pop(old)
            init(self, *args, **kw)

        cls.__init__ = __init__
        return cls

    return wrap


def _split(text: str, cast, what: str):
    try:
        return [cast(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None


def int_list(text: str) -> list[int]:
    """argparse type: ``0,1,2`` -> [0, 1, 2]."""
    return _split(text, int, "integers")


def float_list(text: str) -> list[float]:
    """argparse type: ``0.1,0.01`` -> [0.1, 0.01]."""
    return _split(text, float, "numbers")


#: the argparse types whose values :func:`add_arguments` checks at the boundary (``_finite``)
_NUMBERS: tuple[Callable[[str], Any], ...] = (int, float, int_list, float_list)


def str_tuple(value: str | Iterable[object]) -> tuple[str, ...]:
    """A string or an iterable of strings as a tuple (normalising config fields)."""
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def seed_tuple(value: str | Iterable[int] | None, error: type[Exception]) -> tuple[int, ...] | None:
    """A seeds field as a tuple of ints (``"0,1,2"`` or an iterable; ``None`` stays ``None``);
    a malformed string raises ``error`` saying how to write it."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(int(s) for s in value.split(",") if s.strip())
        except ValueError:
            raise error(f"--seeds must be comma-separated integers, e.g. 0,1,2 (got {value!r})") from None
    return tuple(int(s) for s in value)
