"""The documentation's links lead somewhere: every relative link and image in the repository's
Markdown names a file that exists inside the repository, and a ``#anchor`` names a heading of
its target. A moved or renamed page, plot or heading fails here instead of on a reader.

Links to other sites (``https:``, ``mailto:``) are not fetched. A link that leaves the
repository (``../..`` past its root, an absolute path, ``file:``) or points into what git
ignores (``.venv``, ``.bench``) is an error: a fresh clone would not have it."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150  # a front door: what pdserve is, how to run it, where the rest is

# Folders that hold no documentation of ours: tool state, builds, outputs; all git-ignored.
NOT_DOCS = {"build", "gpu_check_out", "node_modules", "__pycache__"}

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HTML_ANCHOR = re.compile(r"""<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str


def markdown_files(root: Path) -> list[Path]:
    """Every ``.md`` file of the repository, skipping hidden and ignored folders."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in NOT_DOCS and not d.endswith(".egg-info")]
        found += [Path(folder) / f for f in files if f.endswith(".md")]
    return sorted(found)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
        else:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[Link]:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("", line)  # `[x](y)` in backticks is an example, not a link
        for pattern in (INLINE_LINK, REFERENCE_DEF, HTML_LINK):
            found += [Link(path, number, m.group(1)) for m in pattern.finditer(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a page offers: one per heading (repeats get -1, -2, ...), and HTML ids."""
    seen, found = Counter(), set()
    previous = ""
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        atx = ATX_HEADING.match(line)
        setext = re.fullmatch(r"\s{0,3}(=+|-+)\s*", line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*"))
        heading = atx.group(2) if atx else previous.strip() if setext else None
        if heading is not None:
            base = slug(heading)
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
        found.update(m.group(1) for m in HTML_ANCHOR.finditer(line))
        previous = line
    return found


def problem(link: Link, root: Path) -> str | None:
    """Why ``link`` does not resolve inside ``root``, or None when it does."""
    target = link.target
    if target.startswith("file:") or target.startswith("/") or target.startswith("\\"):
        return "points outside the repository (absolute path)"
    if SCHEME.match(target) or target.startswith("//"):
        return None  # another site: not checked here
    path_part, _, anchor = target.partition("#")
    dest = (link.source.parent / unquote(path_part)).resolve() if path_part else link.source.resolve()
    try:
        inside = dest.relative_to(root.resolve())
    except ValueError:
        return "points outside the repository"
    if any(part.startswith(".") or part in NOT_DOCS for part in inside.parts):
        return "points into an ignored folder that a fresh clone does not have"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
        return f"no heading #{anchor} in {inside}"
    return None


def problems(root: Path) -> list[str]:
    found = []
    for path in markdown_files(root):
        for link in links(path):
            why = problem(link, root)
            if why:
                found.append(f"{link.source.relative_to(root)}:{link.line}: {link.target}: {why}")
    return found


def test_every_relative_link_resolves():
    files = markdown_files(ROOT)
    assert ROOT / "README.md" in files and ROOT / "docs" / "architecture.md" in files, files
    assert sum(len(links(p)) for p in files) > 20  # the checker sees the docs' links at all
    assert problems(ROOT) == []


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES, "move detail into docs/ and link to it"
    for command in ("make serve", "make test ", "make test-quick"):  # CI runs the README's test command
        assert command in readme, command
    linked = {link.target.partition("#")[0] for link in links(ROOT / "README.md")}
    unlinked = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
                      if p.relative_to(ROOT).as_posix() not in linked)
    assert unlinked == [], "the README's map of docs/ misses these pages"


@pytest.mark.parametrize("target, why", [
    ("missing.md", "no such file"),
    ("page.md#no-such-heading", "no heading #no-such-heading"),
    ("#nowhere", "no heading #nowhere"),
    ("../outside.md", "outside the repository"),
    ("/etc/passwd", "absolute path"),
    ("file:///etc/passwd", "absolute path"),
    (".venv/lib.md", "ignored folder"),
])
def test_the_checker_reports_a_broken_link(tmp_path, target, why):
    (tmp_path / "outside.md").write_text("# Outside\n")
    root = tmp_path / "repo"
    (root / ".venv").mkdir(parents=True)
    (root / ".venv" / "lib.md").write_text("# Lib\n")
    (root / "page.md").write_text("# A page\n\n## Its `second` heading: (issue 3)\n\nSee [this](#a-page).\n")
    (root / "README.md").write_text(f"# Readme\n\nSee [it]({target}).\n")
    found = problems(root)
    assert len(found) == 1 and why in found[0], found


def test_the_checker_accepts_what_resolves(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "plot.png").write_bytes(b"")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Its `second` heading: (issue 3)\n\n## Twice\n\n## Twice\n\n![plot](plot.png)\n"
        "[top](#page) [up](../README.md#readme)\n")
    (tmp_path / "README.md").write_text(
        "# Readme\n\n[a](docs/page.md#its-second-heading-issue-3) [b](docs/page.md#twice-1)\n"
        "[c](https://example.com/x.md) `[not a link](nowhere.md)`\n\n```\n[nor](this.md)\n```\n"
        "[ref]: docs/plot.png\n")
    assert problems(tmp_path) == []
