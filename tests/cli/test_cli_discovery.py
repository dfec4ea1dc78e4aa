"""A stage's commands and its checks beside a store are found from its cli.py alone: a package
folder holding one cli.py (here a temporary one on the package's path) adds its command to
``featcache`` and its check to ``featcache verify``, no list edited."""

from __future__ import annotations

import sys

import pytest

import featcache
from featcache import cli
from featcache.store import open_cache
from featcache.store.verify import BESIDE_CHECKS

STAGE = '''
"""``featcache hello``: a stage in one file."""

BESIDE_STORE = {"hello check": "featcache.fchello.cli:check"}


def register(subparsers) -> None:
    p = subparsers.add_parser("hello", help="say hello")
    p.add_argument("--name", default="world")
    p.set_defaults(func=run)


def run(args) -> int:
    print(f"hello {args.name}")
    return 0


def check(path, repair):
    return [f"hello check saw {path.rsplit('/', 1)[-1]}"]
'''


@pytest.fixture
def stage(tmp_path, monkeypatch):
    (tmp_path / "fchello").mkdir()
    (tmp_path / "fchello" / "cli.py").write_text(STAGE)
    monkeypatch.setattr(featcache, "__path__", [*featcache.__path__, str(tmp_path)])
    monkeypatch.setattr(cli, "BESIDE_STORE", dict(cli.BESIDE_STORE))
    with cli.COMMANDS.restored(), BESIDE_CHECKS.restored():
        cli.discover()
        yield
    for name in ("featcache.fchello.cli", "featcache.fchello"):
        sys.modules.pop(name, None)


def test_a_stage_cli_module_adds_its_command_without_a_list(stage, capsys):
    assert cli.COMMANDS.entry("hello").spec == "featcache.fchello.cli:register"
    assert "hello" in cli.build_parser().format_help()
    assert cli.main(["hello", "--name", "there"]) == 0
    assert capsys.readouterr().out == "hello there\n"
    assert "featcache.fchello.cli" in sys.modules


def test_a_stage_check_beside_the_store_runs_in_featcache_verify(stage, tmp_path, capsys):
    open_cache(str(tmp_path / "s.zarr"), "a")
    assert "featcache.fchello.cli" not in sys.modules  # found, not imported
    assert cli.main(["verify", str(tmp_path / "s.zarr")]) == 1
    assert "hello check saw s.zarr" in capsys.readouterr().out
    assert BESIDE_CHECKS.entry("hello check").spec == "featcache.fchello.cli:check"


def test_the_command_listing_follows_the_stages_help_order():
    """``featcache --help`` lists the commands in the order the stages' ``HELP_ORDER`` literals
    give (the workflow: extract first, the demo last), not by package name."""
    words = list(cli.COMMANDS)
    assert words[0] == "extract"
    assert words[-1] == "demo"
    assert words.index("ls") < words.index("probe") < words.index("retrieve") < words.index("rank")
    orders = [cli._declared(p)[2] for p in sorted(cli.Path(featcache.__path__[0]).glob("*/cli.py"))]
    assert 100 not in orders  # every built-in stage declares its place
