"""The front door and its pages: every relative link and #anchor in README.md and docs/*.md
resolves (pages move and headings change; a dead link is how a newcomer finds out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are examples)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return re.sub(r"`[^`\n]*`", "``", "\n".join(lines))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes, -N for repeats."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http(s)://, mailto: and the like are not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    readme = _prose((ROOT / "README.md").read_text())
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme)}
    orphans = [p.name for p in PAGES[1:] if p.name not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"
