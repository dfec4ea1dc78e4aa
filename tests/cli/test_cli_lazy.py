"""``featcache COMMAND`` builds only the parsers of the module that registers COMMAND: the
table that says which module that is agrees with what the modules register, and a lazily built
parser reads a command line exactly as the full one does."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from featcache import cli


def _choices(parser: argparse.ArgumentParser) -> set[str]:
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def test_the_command_table_is_what_the_modules_register():
    for module in cli.COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers(dest="command")
        importlib.import_module(module).register(sub)
        assert set(sub.choices) == {c for c, m in cli.COMMANDS.items() if m == module}, module
    assert set(cli.COMMANDS.values()) <= set(cli.COMMAND_MODULES)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["probe", "--cache", "c"], "probe"),
        (["-q", "-vv", "--log-file", "x.log", "ls", "c"], "ls"),
        (["--log-file=x.log", "rank", "r"], "rank"),
        (["--log-file", "probe", "ls"], "ls"),  # the log file's name is no command
        (["-h", "probe"], None),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_word_is_found_after_the_global_flags(argv, command):
    assert cli.command_of(argv) == command


def test_a_command_builds_its_own_module_only_and_help_builds_every_one():
    everything = set(cli.COMMANDS)
    assert _choices(cli.build_parser()) == everything
    assert _choices(cli.build_parser(["probe", "--help"])) == {"probe"}
    assert _choices(cli.build_parser(["-q", "extract"])) == {
        c for c, m in cli.COMMANDS.items() if m.endswith("extract.cli")
    }
    for argv in (["--help"], [], ["no-such-command"]):  # the listing and argparse's error name every command
        assert _choices(cli.build_parser(argv)) == everything


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--cache", "c", "--all", "--results", "r.parquet", "--protocol", "fewshot:5"],
        ["-q", "extract", "--model", "tf_efficientnet_lite0", "--data", "digits", "--cache", "c.zarr"],
        ["ls", "c.zarr"],
        ["rank", "--results", "r.parquet", "--out", "o"],
    ],
)
def test_a_lazily_built_parser_reads_a_command_line_as_the_full_one(argv):
    lazy, full = cli.build_parser(argv).parse_args(argv), cli.build_parser().parse_args(argv)
    assert vars(lazy) == vars(full)


def test_featcache_probe_imports_no_other_command_module():
    code = (
        "import sys\n"
        "from featcache.cli import main\n"
        "try:\n"
        "    main(['probe', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('featcache.') and m.endswith('.cli'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: featcache probe" in out
    assert out.strip().splitlines()[-1] == "featcache.cli,featcache.probes.cli"
