"""Where a test run's time went, from pytest's JUnit XML files (``--junitxml``).

    python3 tools/junit_summary.py reports/junit-local.xml reports/junit-dbr.xml [--top 20]
        [--warn-test 90]

Prints, for each file: its suite's total, the seconds per test file, and the ``--top``
slowest tests (setup, call and teardown together, as JUnit records them); with
``--warn-test S``, a ``WARNING`` line for each test that took longer than ``S`` seconds (the
gate's bound per test, docs/testing.md: a warning, never a failure). Standard library only:
``.ci/run`` calls it with the system Python, also when a suite failed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def _file_and_test(classname: str, name: str) -> tuple[str, str]:
    """``("tests/unit/vision/test_images.py", "TestX::test_y")`` from a JUnit ``classname``
    (``tests.unit.vision.test_images.TestX``) and a test ``name``: the file is the dotted
    path up to the first ``test_`` part."""
    parts = classname.split(".")
    index = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
    if index is None:
        return classname, name
    rest = parts[index + 1 :]
    return "/".join(parts[: index + 1]) + ".py", "::".join([*rest, name])


def _cases(path: Path) -> list[tuple[str, str, float, str]]:
    """``(file, test, seconds, outcome)`` of every test case in a JUnit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        name = case.get("name", "")
        outcome = next(
            (tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed"
        )
        file, test = _file_and_test(module, name)
        cases.append((file, test, float(case.get("time", 0.0)), outcome))
    return cases


def summarize(path: Path, top: int) -> str:
    """The report of one JUnit XML file, as text."""
    cases = _cases(path)
    total = sum(seconds for _, _, seconds, _ in cases)
    outcomes: dict[str, int] = defaultdict(int)
    per_file: dict[str, float] = defaultdict(float)
    for file, _, seconds, outcome in cases:
        per_file[file] += seconds
        outcomes[outcome] += 1
    lines = [
        f"== {path}: {len(cases)} tests, {total:.0f} s in tests ("
        + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
        + ")",
        "   seconds per file:",
    ]
    lines += [f"   {s:7.1f}  {f}" for f, s in sorted(per_file.items(), key=lambda x: -x[1])]
    lines.append(f"   the {top} slowest tests:")
    slowest = sorted(cases, key=lambda c: -c[2])[:top]
    lines += [f"   {s:7.1f}  {f}::{t}  [{o}]" for f, t, s, o in slowest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JUnit XML files")
    parser.add_argument("--top", type=int, default=20, help="how many slowest tests to list")
    parser.add_argument(
        "--warn-test", type=float, default=None, help="warn of each test over this many seconds"
    )
    args = parser.parse_args(argv)
    warnings = []
    for path in args.files:
        if not path.is_file():
            print(f"== {path}: missing (that suite did not run)")
            continue
        try:
            print(summarize(path, args.top))
        except ET.ParseError as exc:
            print(f"== {path}: unreadable JUnit XML: {exc}")
            continue
        if args.warn_test is not None:
            warnings += [
                f"WARNING: {f}::{t} took {s:.0f} s, over the gate's {args.warn_test:.0f} s per test"
                f" ({path.name})"
                for f, t, s, _ in _cases(path)
                if s > args.warn_test
            ]
    for line in warnings:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
