"""The front door and its pages. Pages move and headings change; a dead link is how a newcomer
finds out, so every relative link and #anchor in README.md, docs/**/*.md and the reports under
results/ must resolve. Every docs page is reachable from the README, the README stays short
enough to read, every committed result file is named by a page, and docs/ holds pages and the
images they show, nothing else (results live in results/<date>/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "results"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
REPORTS = sorted(RESULTS.rglob("*.md"))  # a bench report's page, beside its files
README_MAX_LINES = 250
IMAGE_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp"}
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")
RESULT_PATH = re.compile(r"results/\d{4}-\d\d-\d\d/[\w./-]*\w")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _unfenced(text: str) -> str:
    """The text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return "\n".join(lines)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are examples)."""
    return re.sub(r"`[^`\n]*`", "``", _unfenced(text))


def _links(page: Path) -> list[tuple[bool, str, Path, str]]:
    """(is an image, the link as written, the file it names, its #anchor) for each relative
    link in the page's prose; http(s)://, mailto: and the like are not checked offline."""
    out = []
    for bang, target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        out.append((bool(bang), target, dest, anchor))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes, -N for repeats."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _unfenced(path.read_text()).splitlines():  # inline code text counts
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


@pytest.mark.parametrize("page", PAGES + REPORTS, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for _, target, dest, anchor in _links(page):
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = {README.resolve()}, [README]
    while todo:
        for _, _, dest, _ in _links(todo.pop()):
            if dest.suffix == ".md" and dest.is_file() and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    orphans = [_rel(p) for p in PAGES if p.resolve() not in reached]
    assert not orphans, f"docs pages no link path from the README reaches: {orphans}"


def test_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to a docs page"
    )


def _referenced_results() -> set[Path]:
    """Files under results/ that a page links or names by path (`results/<date>/<file>`), and
    those a report links once a page references that report."""
    referenced: set[Path] = set()
    todo = list(PAGES)
    while todo:
        page = todo.pop()
        named = [dest for _, _, dest, _ in _links(page)]
        named += [ROOT / m for m in RESULT_PATH.findall(page.read_text())]
        for dest in named:
            dest = dest.resolve()
            if dest.is_file() and dest not in referenced:
                referenced.add(dest)
                if dest.suffix == ".md" and RESULTS.resolve() in dest.parents:
                    todo.append(dest)
    return referenced


def test_every_result_file_is_referenced() -> None:
    referenced = _referenced_results()
    unreferenced = [_rel(f) for f in sorted(RESULTS.rglob("*"))
                    if f.is_file() and f.resolve() not in referenced]  # fmt: skip
    assert not unreferenced, (
        f"result files no page (README, docs/) links or names: {unreferenced}; "
        "say what each run shows on the page of its feature, or delete the file"
    )


def test_results_are_filed_by_date() -> None:
    dated = re.compile(r"\d{4}-\d\d-\d\d")
    files = [f for f in sorted(RESULTS.rglob("*")) if f.is_file()]
    misplaced = [_rel(f) for f in files if not dated.fullmatch(f.relative_to(RESULTS).parts[0])]
    assert not misplaced, f"results files outside a results/<YYYY-MM-DD>/ folder: {misplaced}"


def test_docs_hold_only_pages_and_the_images_they_show() -> None:
    shown = {dest for page in PAGES for image, _, dest, _ in _links(page) if image}
    stray = [_rel(f) for f in sorted(DOCS.rglob("*")) if f.is_file() and f.suffix != ".md"
             and not (f.suffix.lower() in IMAGE_SUFFIXES and f.resolve() in shown)]  # fmt: skip
    assert not stray, (
        f"docs/ holds files that are not pages or images a page shows: {stray}; "
        "results (JSON, plots) go to results/<date>/"
    )
