"""Exit 0 only if a pytest junit report shows tests that ran, none failed, errored or was skipped.

    python scripts/junit_check.py REPORT.xml LABEL

The CI scripts of the separate environments (vLLM, TRL, ms-swift, AReaL, Trinity-RFT) end with it: a framework that
is missing there must fail CI, never pass as a row of skips.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/junit_check.py REPORT.xml LABEL", file=sys.stderr)
        return 2
    path, label = argv
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    print(f"{label} tests: {tests} collected, {bad} failed, {skipped} skipped")
    return 0 if tests > 0 and bad == 0 and skipped == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
