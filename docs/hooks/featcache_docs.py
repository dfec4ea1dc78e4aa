"""MkDocs hook: pages generated at build time, so they cannot drift from the code.

* ``cli.md``: the CLI reference, from ``featcache.cli.build_parser()`` (every sub-command's
  usage, description and options, walked from the argparse parsers).
* ``api/<module>.md``: one mkdocstrings page per module listed in ``extra.api_modules`` of
  ``mkdocs.yml`` that exists in this checkout (a stage another branch adds shows up once it
  is merged); the pages are appended to the "API reference" nav section.
* mkdocstrings is pointed at this checkout: the repository root *is* the package
  ``featcache``, so a temporary directory with a ``featcache`` link to the root goes first on
  the handler's ``paths``.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
_PKG_DIR = Path(tempfile.mkdtemp(prefix="featcache-docs-"))
(_PKG_DIR / "featcache").symlink_to(ROOT, target_is_directory=True)
atexit.register(shutil.rmtree, _PKG_DIR, ignore_errors=True)  # removes the link, not the checkout
if str(_PKG_DIR) not in sys.path:  # the CLI page imports featcache.cli from this checkout
    sys.path.insert(0, str(_PKG_DIR))


def _source(module: str) -> Path | None:
    """The file of ``featcache.<module>`` in THIS checkout (not whatever ``featcache`` another
    installation on sys.path provides), or None."""
    rel = Path(*module.split(".")[1:])
    for cand in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _present(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith("featcache.") and _source(m) is not None]


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    handlers = config.plugins["mkdocstrings"].config.handlers
    python = handlers.setdefault("python", {})
    python["paths"] = [str(_PKG_DIR), *python.get("paths", [])]
    modules = _present(config.extra.get("api_modules", []))
    config.extra["api_present"] = modules
    pages = [{m: f"api/{m.removeprefix('featcache.')}.md"} for m in modules]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = list(entry["API reference"] or []) + pages
    return config


def on_files(files, config):
    files.append(File.generated(config, "cli.md", content=cli_markdown()))
    files.append(File.generated(config, "api/index.md", content=api_index(config.extra["api_present"])))
    for m in config.extra["api_present"]:
        text = f"# `{m}`\n\n::: {m}\n"
        files.append(File.generated(config, f"api/{m.removeprefix('featcache.')}.md", content=text))
    return files


def api_index(modules: list[str]) -> str:
    lines = [
        "# API reference",
        "",
        "Rendered from the docstrings. The library takes what the CLI builds: each command's",
        "flags map onto the keyword arguments documented here.",
        "",
        "| module | |",
        "|---|---|",
    ]
    for m in modules:
        source = _source(m).read_text(encoding="utf-8")  # read, not imported (no torch at build time)
        doc = ast.get_docstring(ast.parse(source)) or ""
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        lines.append(f"| [`{m}`]({m.removeprefix('featcache.')}.md) | {_cell(summary)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- CLI reference


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name), sub


def _cell(text: str, code: bool = False) -> str:
    """Table-cell text: pipes escaped and, outside code, markup (``[a][b]`` is no link,
    ``NAME@random<SEED>`` no HTML tag)."""
    if not code:
        return _text(text).replace("|", "\\|").replace("\n", " ")
    return text.replace("|", "\\|").replace("\n", " ")


def _text(text: str) -> str:
    """Argparse help as literal Markdown text: brackets, ``<``, ``&`` and ``*`` escaped
    (``[,split][,id]`` is no link, ``<SEED>`` no HTML tag, ``a * b`` no emphasis)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    for ch in "[]*":
        text = text.replace(ch, "\\" + ch)
    return text


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | help |", "|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(a.option_strings) or a.dest
        if a.option_strings and a.nargs != 0:
            meta = a.metavar if isinstance(a.metavar, str) else " ".join(a.metavar or ()) or a.dest.upper()
            names += "" if a.choices else f" {meta}"
        if a.choices:
            names += " {" + ",".join(map(str, a.choices)) + "}"
        default = "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`"
        helptext = parser._get_formatter()._expand_help(a) if a.help else ""  # %(default)s etc.
        rows.append(f"| `{_cell(names, True)}` | {_cell(default, True)} | {_cell(helptext)} |")
    return rows if len(rows) > 2 else []


def _command_section(name: str, parser: argparse.ArgumentParser, summary: str | None, level: int) -> list[str]:
    out = [f"{'#' * level} `{parser.prog}`", ""]
    if summary:
        out += [_text(summary), ""]
    if parser.description and parser.description != summary:
        out += [_text(parser.description), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    out += [*_options_table(parser), ""]
    if parser.epilog:
        out += ["```text", parser.epilog.strip(), "```", ""]
    for sub_name, sub_help, sub in _subparsers(parser):
        out += _command_section(sub_name, sub, sub_help, level + 1)
    return out


def cli_markdown() -> str:
    os.environ.setdefault("COLUMNS", "100")  # argparse wraps usage lines to the terminal width
    from featcache.cli import build_parser

    parser = build_parser()
    lines = [
        "# CLI reference",
        "",
        "Generated at build time from the argparse parsers (`featcache.cli.build_parser()`);",
        "`featcache COMMAND --help` prints the same. Global options go before the command",
        "(`featcache -q --log-file run.log extract ...`).",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        *_options_table(parser),
        "",
    ]
    for name, summary, sub in _subparsers(parser):
        lines += _command_section(name, sub, summary, 2)
    return "\n".join(lines)
