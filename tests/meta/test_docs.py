"""The docs a user reads: the README is the front door (short, every docs page one link away),
the pages link to what exists, and they speak of the software, not of its history or of the
machine a sentence was written on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import DOCS, README, ROOT, user_pages

README_MOST_LINES = 220


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES, f"README.md has {len(lines)} lines"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", readme))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - linked == set(), "pages the README does not link"


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), f"{page}: link to {target} goes nowhere"
        assert ROOT in resolved.parents or resolved == ROOT


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lowercased, punctuation dropped, spaces as
    hyphens, a repeated slug numbered; headings inside fenced code are not headings."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if fenced or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.name)
def test_every_anchor_names_a_heading(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md|)#([^)\s]+)\)", text):
        linked = (page.parent / target).resolve() if target else page
        assert anchor in _anchors(linked), f"{page}: no heading {anchor!r} in {linked.name}"


HISTORY = re.compile(
    r"this machine|used to be|until now|no gpu has been lent|has been lent|so far, so"
    r"|measured here|no longer|before this change|after this change|\blent\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.name)
def test_the_docs_speak_in_the_present(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = sorted({m.group(0) for m in HISTORY.finditer(text)})
    assert not found, f"{page}: {found}"
