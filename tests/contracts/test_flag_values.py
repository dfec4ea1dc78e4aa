"""Contract (issue 60, deliverable 9): every CLI flag that takes a number, fed ``nan``, ``inf``,
``-1``, ``0`` and ``1e400``, is answered by a one-line error naming the flag or a value the
command accepts; never a traceback. The list of flags is generated from the parsers
:func:`featcache.cli.build_parser` builds, so a new numeric flag is covered the day it lands.

Parse-and-validate only: each command's config is built from the parsed arguments (the job
is not run); commands without a config (rank, shift, demo) run through ``main`` with their
work replaced by a stub that stops at the call.
"""

from __future__ import annotations

import argparse

import pytest

from featcache.cli import build_parser, main
from featcache.errors import FeatcacheError

#: argparse types (by name: the flag machinery wraps them) that make a flag numeric, plus
#: every flag named in SIZES (a size text)
NUMERIC_NAMES = ("int", "float", "int_list", "float_list", "_ks", "parse_limit")
SIZES = ("--max-memory",)
VALUES = ("nan", "inf", "-1", "0", "1e400")
#: values that never are a valid number of anything
NEVER = ("nan", "inf", "1e400")

#: the fewest words each command needs besides the flag under test
REQUIRED = {
    "extract": ["--model", "m", "--data", "digits", "--cache", "c"],
    "finetune": ["--model", "m", "--data", "digits", "--results", "r.parquet"],
    "probe": ["--cache", "c", "--dataset", "d", "--all", "--results", "r.parquet"],
    "retrieve": ["--cache", "c", "--dataset", "d", "--all", "--query", "q", "--gallery", "g", "--results", "r.parquet"],
    "similarity": ["--cache", "c", "--dataset", "d", "--all"],
    "audit": ["--cache", "c", "--dataset", "d", "--backbone", "a", "--out", "o.parquet"],
    "sweep": ["--cache", "c", "--results", "r.parquet"],
    "rank": ["--results", "r.parquet", "--out", "o"],
    "shift": ["--results", "r.parquet", "--orig", "test", "--new", "v2", "--out", "o"],
    "demo": [],
    "dense": ["--cache", "c", "--dataset", "d", "--backbones", "a"],
}


def _builders() -> dict:
    from featcache.dense.config import DenseConfig
    from featcache.extract.config import ExtractConfig
    from featcache.finetune import cli as finetune_cli
    from featcache.probes import cli as probe_cli
    from featcache.retrieval.config import RetrievalConfig
    from featcache.similarity.config import AuditConfig, SimilarityConfig
    from featcache.sweep import cli as sweep_cli

    return {
        "extract": ExtractConfig.from_args,
        "finetune": lambda a: finetune_cli.config_from_args(a).resolve(),
        "probe": lambda a: probe_cli.config_from_args(a).resolve(),
        "retrieve": RetrievalConfig.from_args,
        "similarity": SimilarityConfig.from_args,
        "audit": AuditConfig.from_args,
        "sweep": sweep_cli.config_from_args,
        "dense": DenseConfig.from_args,
    }


#: where a command without a config starts its work (replaced by a stub in this test)
WORK = {
    "rank": "featcache.analysis.api.rank",
    "shift": "featcache.analysis.api.shift",
    "demo": "featcache.demo.cli.run",
}


def _numeric(action: argparse.Action) -> bool:
    return getattr(action.type, "__name__", "") in NUMERIC_NAMES or action.option_strings[0] in SIZES


def numeric_flags() -> list[tuple[str, str]]:
    """``(command, flag)`` for every flag of every command whose value is a number."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(
        (cmd, a.option_strings[0])
        for cmd, sp in sub.choices.items()
        for a in sp._actions
        if a.option_strings and a.nargs != 0 and a.choices is None and _numeric(a)
    )


FLAGS = numeric_flags()


def test_the_generated_list_holds_the_flags_the_issue_names():
    for want in (
        ("similarity", "--max-memory"),
        ("similarity", "--rbf-threshold"),
        ("similarity", "--rbf-sigma"),
        ("audit", "--max-memory"),
        ("audit", "--threshold"),
        ("probe", "--batch-size"),
    ):
        assert want in FLAGS
    assert {c for c, _ in FLAGS} <= set(REQUIRED), "a new command with numeric flags: add its words to REQUIRED"


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_the_required_words_alone_are_accepted(command, monkeypatch, capsys, tmp_path):
    """Else every refusal below could be the missing word's, not the value's."""
    monkeypatch.chdir(tmp_path)
    assert _answer(command, [command, *REQUIRED[command]], monkeypatch, capsys) == ("accepted", "")


class _Stop(Exception):
    """The stub of a command's work: reached means every value was accepted."""


def _answer(command: str, argv: list[str], monkeypatch, capsys) -> tuple[str, str]:
    """``("refused", message)`` or ``("accepted", "")`` for one command line (nothing runs)."""
    builders = _builders()
    try:
        args = build_parser(argv).parse_args(argv)
        if command not in builders:
            monkeypatch.setattr(WORK[command], _stub)
            rc = main(argv)
            err = capsys.readouterr().err.strip()
            return ("refused", err) if rc in (1, 2) and err else (f"exit {rc} without an error", err)
        builders[command](args)
    except _Stop:
        return "accepted", ""
    except SystemExit as exc:  # argparse: usage lines, then one error line
        return ("refused" if exc.code == 2 else f"exit {exc.code}"), capsys.readouterr().err.strip().splitlines()[-1]
    except FeatcacheError as exc:
        return "refused", str(exc)
    return "accepted", ""


def _stub(*args, **kwargs):
    raise _Stop


@pytest.mark.parametrize(("command", "flag"), FLAGS, ids=[f"{c}{f}" for c, f in FLAGS])
@pytest.mark.parametrize("value", VALUES)
def test_every_numeric_flag_answers_every_value_in_one_line(command, flag, value, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    argv = [command, *REQUIRED[command], f"{flag}={value}"]
    verdict, message = _answer(command, argv, monkeypatch, capsys)
    assert verdict in ("refused", "accepted"), f"{argv}: {verdict}: {message}"
    if verdict == "refused":
        assert "\n" not in message, message
        assert "Traceback" not in message, message
        names = (flag, flag.lstrip("-").replace("-", "_"))  # the flag, or its field (library users)
        assert any(n in message for n in names), f"{argv}: the refusal does not name {flag}: {message}"
    else:
        assert value not in NEVER, f"{argv}: {value} accepted as a number"
