"""The docs agree with themselves: every link into docs/ lands on a file and a heading, and
every figure of the README's results table stands in the benchmark section its row links to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
PAGES = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
# A figure: 6,016, -200, 0.88, 1.88× (not the 5 of Hopper-v5, the 200 of H200 or a version's parts).
NUMBER = re.compile(r"(?<![\w.,-])-?\d+(?:,\d{3})*(?:\.\d+)?(?![\w.]|,\d)")


def headings(page: Path) -> list[tuple[int, str, int]]:
    """Each heading outside code blocks: its level, its GitHub anchor and its line number."""
    found, seen, fenced = [], {}, False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#{1,6}) (.+)", line)
        if match:
            # GitHub's anchor: lower case, punctuation dropped, spaces as hyphens, repeats numbered.
            anchor = re.sub(r"[^\w\- ]", "", match[2].strip().lower()).replace(" ", "-")
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.append((len(match[1]), anchor if count == 0 else f"{anchor}-{count}", number))
    return found


def section(page: Path, anchor: str) -> str:
    """The text under a heading, down to the next heading of its level or above."""
    lines = page.read_text(encoding="utf-8").splitlines()
    marks = headings(page)
    for index, (level, name, start) in enumerate(marks):
        if name == anchor:
            end = next((line for lvl, _, line in marks[index + 1 :] if lvl <= level), len(lines))
            return "\n".join(lines[start:end])
    raise AssertionError(f"{page.name} has no heading #{anchor}")


def figures(text: str) -> set[str]:
    return set(NUMBER.findall(LINK.sub(r"\1", text)))


def results_rows() -> list[str]:
    readme = (PROJECT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [row for row in rows if not row.startswith(("| recipe", "| ---"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_into_the_docs_lands_on_a_file_and_a_heading(page):
    for _, target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or not (target.startswith("#") or ".md" in target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_file(), f"{page.name} links to {target}: no such file"
        if anchor:
            anchors = {name for _, name, _ in headings(linked)}
            assert anchor in anchors, f"{page.name} links to {target}: {linked.name} has no such heading"


def test_the_results_table_has_a_row_per_recipe_each_linking_to_benchmarks():
    rows = results_rows()
    assert rows, "README.md has no results table"
    for row in rows:
        assert "docs/benchmarks.md#" in row, f"a results row links to no benchmark section: {row}"


def test_every_figure_of_the_results_table_is_in_the_section_it_links_to():
    benchmarks = PROJECT / "docs" / "benchmarks.md"
    for row in results_rows():
        anchors = re.findall(r"\]\(docs/benchmarks\.md#([\w-]+)\)", row)
        sections = "\n".join(section(benchmarks, anchor) for anchor in anchors)
        missing = figures(row) - figures(sections)
        assert not missing, f"README's row {row.split('|')[1].strip()!r}: {sorted(missing)} not in {anchors}"
