"""The user docs stay true to the repository: every relative link in README.md, examples/README.md and
docs/*.md resolves (files, folders and `#anchors` into Markdown headings, by GitHub's anchor rule), and each
public strategy's section of docs/strategies.md has one argument table naming every keyword of its constructor."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import lightning_par

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "examples" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """GitHub's heading id: links reduced to their text, lower case, every character that is not a letter,
    digit, underscore, hyphen or space dropped, spaces turned into hyphens.

    >>> github_anchor("A model larger than one device: meta build and `weights=`")
    'a-model-larger-than-one-device-meta-build-and-weights'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def test_github_anchor_rule():
    assert github_anchor("Fault tolerance: lose a replica, keep training (torchft)") == \
        "fault-tolerance-lose-a-replica-keep-training-torchft"
    assert github_anchor('Sizes and `"auto"`') == "sizes-and-auto"
    assert github_anchor("The advisor: `lightning-par-advise`") == "the-advisor-lightning-par-advise"


def test_docs_exist_and_readme_is_short():
    assert len(PAGES) > 5, PAGES
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", FENCE.sub("", text), re.M | re.S)
    assert match, f"docs/strategies.md has no section `## {title}`"
    return match[1]


@pytest.mark.parametrize("name", lightning_par.__all__)
def test_every_strategy_keyword_is_in_its_argument_table(name):
    cls = getattr(lightning_par, name)
    section = _section((REPO / "docs" / "strategies.md").read_text(), name)
    tables = re.findall(r"(?:^\|.*\|[ \t]*(?:\n|\Z))+", section, re.M)
    assert len(tables) == 1, f"{name}: expected one argument table in its section, found {len(tables)}"
    first_column = " ".join(row.split("|")[1] for row in tables[0].splitlines())
    documented = set(re.findall(r"`(\w+)`", first_column))
    keywords = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    missing = [k for k in keywords if k not in documented]
    assert not missing, f"{name}'s keywords missing from its table in docs/strategies.md: {missing}"


def test_readme_links_every_docs_page():
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_prose((REPO / "README.md").read_text()))
              if t.startswith("docs/")}
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, sorted(pages - linked)
