"""Screenshot every section of a featcache HTML report in headless Chromium (1280 px wide).

    python benchmarks/report_screenshots.py featcache-demo/report.html shots/

Writes ``shots/<section>.png`` (and ``shots/page.png``, the whole page) and prints, per section,
its size; it also prints the page checks the browser test makes (images decoded, page width,
console errors). Uses Debian's /usr/bin/chromium through the DevTools pipe; downloads nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))

from cdp import PAGE_FACTS, SECTION_RECTS, Browser, find_chromium


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--width", type=int, default=1280)
    args = p.parse_args(argv)
    exe = find_chromium()
    if exe is None:
        print("chromium not found (apt-get install chromium)", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as prof, Browser(exe, prof) as b:
        b.open(args.report.resolve().as_uri(), width=args.width)
        facts = b.evaluate(PAGE_FACTS)
        print(
            f"page: scrollWidth {facts['scrollWidth']} (window {args.width}), "
            f"{sum(i['w'] > 0 for i in facts['images'])}/{len(facts['images'])} images decoded, "
            f"console errors: {b.errors() or 'none'}"
        )
        b.screenshot(args.out / "page.png")
        for r in b.evaluate(SECTION_RECTS):
            clip = {k: r[k] for k in ("x", "y", "width", "height")}
            path = b.screenshot(args.out / f"{r['id']}.png", clip)
            print(f"{r['id']:>10}: {int(r['width'])} x {int(r['height'])} px -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
