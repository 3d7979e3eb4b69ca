"""The README and the pages under docs/: every relative link resolves to a file of the
repository, and every `#anchor` to a heading of the page it names (GitHub's anchor rules)."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: pathlib.Path) -> list[str]:
    """The link targets of `page`, outside code blocks and inline code."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: pathlib.Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in "
                          f"{dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


def test_docs_have_pages() -> None:
    """The README links to every page under docs/."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [p.relative_to(ROOT) for p in PAGES[1:] if p not in linked]
    assert not missing, f"README.md does not link to {missing}"
