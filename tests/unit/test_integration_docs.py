"""The framework pages' option tables (docs/integrations/*.md, "Common settings") cite tests that exist, and every
row they call exact names the test behind it: a renamed or deleted test, or an "exact" claim without one, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs" / "integrations").glob("*.md"))
TEST_NAME = re.compile(r"`(?:[\w/.]+::)?(test_\w+)(?:\[[^`]*\])?`")


def _test_functions() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*def (test_\w+)\(", path.read_text(encoding="utf-8"), flags=re.M))
    return names


def _settings_rows(page: Path) -> list[list[str]]:
    """The cells of each row of the page's "Common settings" table (header and rule left out)."""
    text = page.read_text(encoding="utf-8")
    start = text.index("## Common settings")
    section = text[start:text.find("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def test_every_framework_page_has_a_settings_table() -> None:
    assert {p.stem for p in PAGES} >= {"areal", "swift", "trinity", "trl"}
    for page in PAGES:
        rows = _settings_rows(page)
        assert len(rows) >= 8, f"{page.name}: the Common settings table has {len(rows)} rows"
        assert all(len(row) == 3 for row in rows), f"{page.name}: a row without 3 cells"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_tables_cite_existing_tests_and_every_exact_row_names_one(page: Path) -> None:
    known = _test_functions()
    previous: list[str] = []
    for setting, status, evidence in _settings_rows(page):
        cited = TEST_NAME.findall(status + " " + evidence)
        missing = [name for name in cited if name not in known]
        assert not missing, f"{page.name}, row {setting[:60]!r}: no test named {missing}"
        if not cited and re.search(r"\bsame tests?\b", evidence):
            cited = previous  # "the same test(s)": the row above's
        if status.startswith("**exact**"):
            # "every engine test" style rows point at the page's whole suite
            assert cited or re.search(r"\b(every|all)\b.*\btests?\b", evidence), \
                f"{page.name}, row {setting[:60]!r} says exact but names no test"
        previous = cited or previous
