"""Progress bars: tqdm on a terminal; elsewhere (a log file, a pipe, CI) one plain line per
``step`` percent instead of tqdm's ``\\r`` frames, so logs stay readable."""

from __future__ import annotations

import sys
import time
from typing import Any

#: percent between two lines when stderr is not a terminal
STEP_PERCENT = 10
#: seconds between two lines of a bar without a total, when stderr is not a terminal
UNSIZED_INTERVAL_S = 60.0


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def tqdm(*args: Any, **kw: Any):
    """``tqdm.auto.tqdm`` on a terminal (or when disabled); a line-per-step bar otherwise."""
    from tqdm.auto import tqdm as _tqdm

    if kw.get("disable") or _isatty(kw.get("file") or sys.stderr):
        return _tqdm(*args, **kw)
    kw.setdefault("ascii", True)  # a log file: no block characters
    return _line_bar_class()(*args, **kw)


_LINE_BAR = None


def _line_bar_class():
    global _LINE_BAR
    if _LINE_BAR is None:
        from tqdm import tqdm as _std

        class LineBar(_std):
            """Writes ``str(self)`` on its own line when the percentage crosses a step (and
            once at the end); never a carriage return."""

            def __init__(self, *a: Any, **k: Any) -> None:
                self._last_step = -1
                self._last_t = 0.0
                self._step = k.pop("step_percent", STEP_PERCENT)
                super().__init__(*a, **k)

            def display(self, msg: str | None = None, pos: int | None = None) -> None:
                if msg == "":  # tqdm clearing a bar: nothing to clear
                    return None
                if self.total:
                    step = int(100 * self.n / self.total) // self._step
                    if step <= self._last_step:
                        return None
                    self._last_step = step
                else:
                    now = time.monotonic()
                    if self._last_t and now - self._last_t < UNSIZED_INTERVAL_S:
                        return None
                    self._last_t = now
                self.fp.write(self.__str__() + "\n")
                self.fp.flush()
                return None

            def close(self) -> None:
                if not self.disable and not getattr(self, "_closed_line", False):
                    self._closed_line = True
                    if not self.total or int(100 * self.n / self.total) // self._step > self._last_step:
                        self._last_step, self._last_t = -1, 0.0
                        self.display()
                self.leave = False  # the last line is written; tqdm would add a blank one
                super().close()

        _LINE_BAR = LineBar
    return _LINE_BAR
