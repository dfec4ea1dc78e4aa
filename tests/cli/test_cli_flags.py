"""Global CLI flags: -q silences INFO logs and progress bars; --log-file keeps a log on disk."""

from __future__ import annotations

import sys
import textwrap

import pytest

from featcache import cli


@pytest.fixture
def probe_command(tmp_path, monkeypatch):
    """A stage module registered the way every stage registers (``register(subparsers)``),
    whose command records what the CLI handed it."""
    (tmp_path / "fc_flagprobe.py").write_text(
        textwrap.dedent("""
        import logging
        seen = {}
        def register(sub):
            p = sub.add_parser("flagprobe")
            p.add_argument("--no-progress", action="store_true")
            p.set_defaults(func=run)
        def run(args):
            seen["no_progress"] = args.no_progress
            logging.getLogger("featcache.flagprobe").info("working on it")
            logging.getLogger("featcache.flagprobe").debug("fine detail")
            return 0
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with cli.COMMANDS.restored():
        cli.COMMANDS.register("flagprobe", "fc_flagprobe:register")
        yield sys.modules.get("fc_flagprobe") or __import__("fc_flagprobe")
    sys.modules.pop("fc_flagprobe", None)


@pytest.mark.parametrize(("flags", "no_progress"), [([], False), (["-q"], True)])
def test_quiet_turns_progress_bars_off(probe_command, flags, no_progress):
    assert cli.main([*flags, "flagprobe"]) == 0
    assert probe_command.seen["no_progress"] is no_progress


def test_log_file_gets_info_even_when_quiet(probe_command, tmp_path):
    log = tmp_path / "run.log"
    assert cli.main(["-q", "--log-file", str(log), "flagprobe"]) == 0
    assert cli.main(["--log-file", str(log), "flagprobe"]) == 0  # appends, no duplicate handlers
    text = log.read_text()
    assert text.count("INFO featcache.flagprobe: working on it") == 2
    assert "fine detail" not in text


def test_log_file_records_the_error(tmp_path, capsys):
    log = tmp_path / "err.log"
    assert cli.main(["--log-file", str(log), "ls", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "no feature cache" in err
    assert "ERROR featcache.cli: featcache ls: error: no feature cache" in log.read_text()


def test_unwritable_log_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["--log-file", str(tmp_path / "no" / "dir.log"), "ls", str(tmp_path)]) == 2
    assert "give a writable path" in capsys.readouterr().err
