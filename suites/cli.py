"""``featcache suites [NAME] [--data-root DIR]``: the shipped benchmark suites and their tasks."""

from __future__ import annotations

import argparse

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 20


def run_suites(args: argparse.Namespace) -> int:
    from featcache.suites import list_suites, load_suite

    if not args.name:
        for name in list_suites():
            s = load_suite(name)
            groups = ", ".join(f"{g} {sum(t.group == g for t in s.tasks)}" for g in s.groups)
            print(f"{name:<12} {len(s.tasks):>2} tasks ({groups}); resize {s.resize}; {s.paper}")
        print("details: featcache suites NAME [--data-root DIR]")
        return 0
    s = load_suite(args.name)
    print(
        f"{s.name}: {s.title}\n  paper: {s.paper}\n  preprocessing: resize {s.resize}"
        + (f", {s.input_size} px" if s.input_size else "")
    )
    for k, v in s.subsets.items():
        print(f"  subset {k}: {v}")
    if s.data:
        print(f"  data: {s.data}")
    present = _present(s, args.data_root) if args.data_root else {}
    for t in s.tasks:
        where = f"  [{present[t.name] or 'missing'}]" if args.data_root else ""
        classes = f"{t.num_classes:>4} classes" if t.num_classes else f"{t.kind:>12}"
        print(f"{t.name:<22} {t.group:<12} {t.metric:<15} {classes}{where}")
        if args.verbose_tasks:
            for k, v in t.splits.items():
                print(f"    split {k}: {v}")
            if t.label:
                print(f"    label: {t.label}")
            for what, v in (("protocols", ", ".join(t.protocols)), ("metrics", ", ".join(t.metrics))):
                if v:
                    print(f"    {what}: {v}")
            for what, v in (("relevance", t.relevance), ("data", t.data)):
                if v:
                    print(f"    {what}: {v}")
            print(f"    source: {t.source}; folder names: {', '.join(t.dir_names)}")
    return 0


def _present(suite, root: str) -> dict[str, str | None]:
    from pathlib import Path

    from featcache.data import detect_spec

    return {
        t.name: next((s for n in t.dir_names for s in [detect_spec(Path(root) / n)] if s), None) for t in suite.tasks
    }


def register(sub) -> None:
    from featcache.suites import suite_names

    names = suite_names()
    p = sub.add_parser("suites", help=f"list the benchmark suites ({names}) and their tasks")
    p.add_argument("name", nargs="?", help=f"a suite ({names}): list its tasks (group, metric, classes)")
    p.add_argument(
        "--data-root", default=None, help="show which tasks have data under this folder (and in which layout)"
    )
    p.add_argument(
        "--splits",
        dest="verbose_tasks",
        action="store_true",
        help="also show each task's split rules, label definition, source and folder names",
    )
    p.set_defaults(func=run_suites)
