"""The README and docs/ hold together: every relative link points at a file or folder of the
repository (and, with a #fragment into a markdown file, at one of its headings), and no page
names a place outside the repository (another checkout's folder, a path of one machine)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside code; the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
# Places outside the repository: the shared folder beside the checkout, paths of one machine.
OUTSIDE = re.compile(r"\.\./shared|\bshared folder\b|/work/|/root/|/tmp/")


def prose(text: str) -> str:
    """`text` without fenced blocks and inline code, where brackets are not links."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's ids for the headings of `page`: lowercased, punctuation dropped, spaces to
    hyphens."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M):
        words = re.sub(r"[^\w\- ]", "", heading.strip().lower())
        ids.add(words.replace(" ", "-"))
    return ids


def links(page: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z]+:", t)]  # (http:, https:, mailto: are not ours to check)


def test_there_are_docs_to_check():
    assert (ROOT / "docs" / "architecture.md") in PAGES
    assert any(links(page) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists() or ROOT not in (where, *where.parents):
            broken.append(f"{target} (no such file in the repository)")
        elif fragment and where.suffix == ".md" and fragment not in anchors(where):
            broken.append(f"{target} (no heading '{fragment}' in {where.name})")
    assert not broken, f"{page.name}: " + ", ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_points_outside_the_repository(page):
    found = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, f"{page.name} names places outside the repository: {found}"


def test_the_anchor_rule_matches_github():
    page = ROOT / "docs" / "api.md"
    assert "who-may-call-what" in anchors(page)
    assert "the-api-openai-tgilorax-and-grpc-clients-and-who-may-call-what" in anchors(page)
