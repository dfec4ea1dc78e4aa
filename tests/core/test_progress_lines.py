"""Progress off a terminal (issue 24): one plain line per 10%, never tqdm's carriage-return frames."""

from __future__ import annotations

import io
import re

from featcache.core.progress import tqdm


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_ten_percent_and_no_carriage_returns():
    out = io.StringIO()
    with tqdm(total=200, desc="extract", unit="img", file=out, mininterval=0) as bar:
        for _ in range(200):
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(re.search(r"(\d+)%", ln).group(1)) for ln in lines] == list(range(0, 101, 10))
    assert all(ln.startswith("extract:") for ln in lines)


def test_an_unsized_bar_off_a_terminal_writes_its_end_once():
    out = io.StringIO()
    for _ in tqdm(iter(range(50)), desc="search", file=out, mininterval=0, leave=False):
        pass
    text = out.getvalue()
    assert "\r" not in text
    assert text.count("\n") == 2  # its start and its end
    assert "50it" in text.splitlines()[-1]


def test_a_terminal_keeps_the_live_bar():
    out = _Tty()
    with tqdm(total=20, desc="extract", file=out, mininterval=0) as bar:
        for _ in range(20):
            bar.update(1)
    assert "\r" in out.getvalue()
