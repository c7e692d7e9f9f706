"""Time by top-level test directory and the slowest tests, from pytest's JUnit XML (docs/testing.md).

Usage: .venv/bin/python -m pytest --junitxml=/tmp/run.xml ...; python scripts/test_times.py /tmp/run.xml [N]
       python scripts/test_times.py --totals FILE...   (one line: "tests: N passed, N failed, N skipped")
Each test's time is its setup + call + teardown, as pytest's JUnit file records it (several files:
the times of the same test add up, e.g. the parallel and the serial invocation of ``make test``).
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if case.find("skipped") is not None else "passed"


def totals(paths: list[str]) -> None:
    """The outcomes of every file's tests added up, as make test's closing line."""
    counts = collections.Counter(
        outcome(case) for path in paths for case in ET.parse(path).getroot().iter("testcase")
    )
    print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")


def main(paths: list[str], slowest: int) -> None:
    by_dir: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    tests = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")
            directory = parts[1] if parts[0] == "tests" and len(parts) > 2 else "tests/*.py"
            seconds = float(case.get("time", 0))
            by_dir[directory] += seconds
            count[directory] += 1
            status = outcome(case)
            name = "/".join(parts[1:]) + "::" + (case.get("name") or "")
            tests.append((seconds, name, status))
    total = sum(by_dir.values())
    print(f"{sum(count.values())} tests, {total:.0f} s of setup + call + teardown")
    print("| directory | tests | seconds | share |\n| --- | ---: | ---: | ---: |")
    for directory, seconds in by_dir.most_common():
        print(f"| {directory} | {count[directory]} | {seconds:.0f} | {100 * seconds / total:.1f}% |")
    print("\n| s | test | outcome |\n| ---: | --- | --- |")
    for seconds, name, status in sorted(tests, reverse=True)[:slowest]:
        print(f"| {seconds:.1f} | {name} | {status} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--totals":
        totals(args[1:])
        sys.exit(0)
    count_arg = int(args.pop()) if len(args) > 1 and args[-1].isdigit() else 50
    main(args, count_arg)
