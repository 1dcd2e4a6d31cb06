"""README.md and docs/ as a newcomer reads them (issue #29, 6): the README stays short, and every
link and every repository path the pages name resolves. `make test` also builds the pages with
`mkdocs build --strict`, which checks the links between pages and their anchors; this test checks
what mkdocs does not see: the README's links into docs/ (with their anchors) and the paths of
scripts, configs and results the pages quote in code spans."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_REPO_PATH = re.compile(r"^(?:bench|etc|grpod|tests|systemd|docs)/[\w./*<>-]*$")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs gives a heading as its anchor)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def _prose(page: Path) -> str:
    return _FENCE.sub("", page.read_text())


def test_the_readme_is_a_walk_not_a_reference():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    """`bench/readme.py`, `bench/results/readme.json`, `etc/examples/...`: a figure's pointer to the
    script and results behind it, or a config a page tells you to run, must be there."""
    missing = []
    for span in _CODE_SPAN.findall(page.read_text()):
        path = span.split(":")[0].split(" ")[0]
        if not _REPO_PATH.match(path) or "<" in path:
            continue
        if not list(ROOT.glob(path.rstrip("/"))):
            missing.append(path)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_atropos_is_offered_only_with_its_archived_state():
    """Atropos was archived on 2026-07-04: every page that tells you how to use it says so."""
    offering = [p for p in PAGES if re.search(r'source\.kind = "atropos"|Atropos environments', p.read_text())]
    assert offering
    silent = [str(p.relative_to(ROOT)) for p in offering if "archived" not in p.read_text()]
    assert not silent, f"pages offering Atropos without saying it is archived: {silent}"
