"""The docs' CLI reference is generated from the argparse parsers: every command and option."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")  # the `docs` extra


def _hook():
    path = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "featcache_docs.py"
    spec = importlib.util.spec_from_file_location("featcache_docs_hook", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_command_and_option_is_in_the_reference():
    from featcache.cli import build_parser

    page = _hook().cli_markdown()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices, "no commands registered"
    for name, p in sub.choices.items():
        assert f"## `featcache {name}`" in page
        for action in p._actions:
            for opt in action.option_strings:
                assert opt in page, (name, opt)
    assert "--log-file" in page
    assert "--quiet" in page
