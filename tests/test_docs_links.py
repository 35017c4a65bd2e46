"""Every relative link between the docs resolves: the file exists, and an ``#anchor`` names a
heading of the page it points at (GitHub's rule for turning a heading into an anchor)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The pages that link to each other: the README, the developers' guide, and docs/.
PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The page without code blocks and inline code, where brackets are not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, each space a ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The relative links of a page (web addresses and mail links left out)."""
    targets = _LINK.findall(_prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z+.-]*:", t)]


def broken(page: Path) -> list[str]:
    """What in a page's links does not resolve, each as ``target: why``."""
    problems = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    return problems


def test_the_anchor_rule_is_githubs(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "# The shared remote tier (Redis / Valkey)\n\n## What sharing a `disk_path` costs\n\n"
        "## Why a lookup did not pay: misses by reason\n\n## Notes\n\n## Notes\n\n"
        "```\n# not a heading\n```\n"
    )  # fmt: skip
    assert anchors(page) == {
        "the-shared-remote-tier-redis--valkey", "what-sharing-a-disk_path-costs",
        "why-a-lookup-did-not-pay-misses-by-reason", "notes", "notes-1",
    }  # fmt: skip


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Here\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#here) [self](#b) [gone](c.md) [bad](a.md#there) `[code](x.md)` "
        "[web](https://example.com/x.md)\n\n# B\n"
    )  # fmt: skip
    assert broken(page) == ["c.md: no such file", "a.md#there: no heading '#there' in a.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []
