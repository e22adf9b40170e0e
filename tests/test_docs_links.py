"""Every relative link in README.md, BENCHMARKS.md and docs/ resolves to a file of this
repository (and, with a #fragment, to a heading of that file); none points outside it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_readme_is_a_front_door():
    """At most 150 lines; everything else lives in docs/ (issue 27)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_check_finds_a_broken_link(tmp_path):
    """The link pattern and the anchor ids see what a reader clicks (not a test that cannot fail)."""
    page = tmp_path / "p.md"
    page.write_text("# A Title, here\n[x](missing.md) ![i](p.md#a-title-here)\n```\n[not](a-link.md)\n```\n")
    assert links(page) == ["missing.md", "p.md#a-title-here"] and "a-title-here" in anchors(page)
