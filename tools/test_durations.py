"""Where the test suite's time goes: a pytest ``--junitxml`` report grouped by file, plus the setup (fixture) and
call time of each file's slowest tests.

Make the report with the README's test command plus ``--junitxml=durations.xml --durations=0``; then
``python tools/test_durations.py durations.xml [--top 25]`` prints a Markdown table (CONTRIBUTING.md keeps one).
junit's ``time`` of a test is its setup + call + teardown, so a module-scoped fixture's cost lands on the first test
that uses it; ``--durations=0``'s ``setup`` lines name it.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def per_file(path: str) -> dict[str, tuple[float, int, float]]:
    """File -> (seconds, tests, slowest test's seconds)."""
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        totals[name].append(float(case.get("time", 0)))
    return {name: (sum(times), len(times), max(times)) for name, times in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    files = per_file(args.report)
    total = sum(seconds for seconds, _, _ in files.values())
    print(f"{sum(n for _, n, _ in files.values())} tests, {total:.0f} s of test time (both workers added up)\n")
    print("| file | tests | seconds | share | slowest test (s) |\n|---|---:|---:|---:|---:|")
    for name, (seconds, count, slowest) in sorted(files.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {name} | {count} | {seconds:.0f} | {100 * seconds / total:.1f}% | {slowest:.0f} |")


if __name__ == "__main__":
    main()
