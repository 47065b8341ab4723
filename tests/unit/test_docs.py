"""The user docs stay true to the repository: every relative link in README.md, examples/README.md and
docs/*.md resolves (files, folders and `#anchors` into Markdown headings, by GitHub's anchor rule); the arguments
table of docs/strategies.md is the one generated from the option groups and names every keyword of every strategy;
and every keyword the pages' examples pass to a strategy, in Python or as `strategy.<key>=`, is one it takes."""
from __future__ import annotations

import doctest
import inspect
import re
from pathlib import Path

import pytest

import lightning_par
from lightning_par import option_docs, options, performance

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


STRATEGY_CALL = re.compile(r"\b(" + "|".join(lightning_par.__all__) + r")\(")
CLI_KEY = re.compile(r"(?<![\w.])\+?strategy\.(\w+)=")
PRESETS = {"ddp": "DataParallelStrategy", "pipeline": "PipelineParallelStrategy", "tensor": "TensorParallelStrategy",
           "hybrid": "HybridParallelStrategy"}  # conf/strategy/<name>.yaml


def _keywords(name: str) -> set[str]:
    parameters = inspect.signature(getattr(lightning_par, name)).parameters
    return {p for p in parameters if p not in ("self", "args", "kwargs")}


def _arguments_rows() -> dict[str, str]:
    """The committed arguments table of docs/strategies.md: argument -> its "applies to" cell."""
    text = (REPO / "docs" / "strategies.md").read_text()
    table = text[text.index(option_docs.BEGIN):text.index(option_docs.END)]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[3]
    return rows


def test_arguments_table_is_generated_from_the_option_groups():
    page = (REPO / "docs" / "strategies.md").read_text()
    assert option_docs.render(page) == page, ("docs/strategies.md's arguments table differs from the option groups: "
                                              "run `python -m lightning_par.option_docs`")


def test_every_option_field_has_a_meaning():
    rows = option_docs.rows()  # raises, naming each field without one
    assert all(len(r["meaning"]) > 10 for r in rows), [r["name"] for r in rows if len(r["meaning"]) <= 10]


@pytest.mark.parametrize("name", lightning_par.__all__)
def test_every_strategy_keyword_is_in_the_arguments_table(name):
    short = option_docs.SHORT[name]
    rows = _arguments_rows()
    documented = {arg for arg, applies in rows.items() if applies == "all" or short in applies.split(", ")}
    keywords = _keywords(name) - set(options.PLUMBING)
    assert documented == keywords, (f"{name}: taken but not in the table {sorted(keywords - documented)}, in the table "
                                    f"but not taken {sorted(documented - keywords)}")


def _call_arguments(text: str, start: int) -> str:
    """The text between the parenthesis opening at ``text[start - 1]`` and the one closing it."""
    depth, i = 1, start
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def _top_level_keywords(arguments: str) -> set[str]:
    flat, depth = [], 0
    for ch in arguments:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        flat.append(ch if depth == 0 else " ")
    return set(re.findall(r"(?:^|[,\s])(\w+)\s*=(?!=)", "".join(flat)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_keyword_exists(page):
    """Every keyword a strategy is called with in the page's code, and every `strategy.<key>=` of a command line,
    in a code block is an argument the strategy takes (a command line's strategy: its `strategy=<preset>`, ddp by
    default)."""
    text, wrong = page.read_text(), []
    for match in STRATEGY_CALL.finditer(text):
        name = match[1]
        for keyword in sorted(_top_level_keywords(_call_arguments(text, match.end())) - _keywords(name)):
            wrong.append(f"{name}({keyword}=...)")
    commands = "\n".join(m[0] for m in FENCE.finditer(text)).replace("\\\n", " ")  # continued lines joined
    for line in commands.splitlines():
        preset = re.search(r"(?<![\w.])(?:strategy|STRATEGY)=(\w+)", line)
        name = PRESETS.get(preset[1] if preset else "ddp")
        if name is None:  # strategy=single: no arguments
            continue
        for key in CLI_KEY.findall(line):
            if key not in _keywords(name):
                wrong.append(f"strategy.{key}= ({name})")
    assert not wrong, f"{page.relative_to(REPO)} documents keywords the code does not take: {wrong}"


def test_readme_links_every_docs_page():
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_prose((REPO / "README.md").read_text()))
              if t.startswith("docs/")}
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, sorted(pages - linked)


def test_limitations_stay_a_list():
    lines = (REPO / "docs" / "limitations.md").read_text().splitlines()
    assert len(lines) <= 120, f"docs/limitations.md has {len(lines)} lines: one line per limitation (what, why, fix)"


def test_generators_doctests():
    assert doctest.testmod(option_docs).failed == 0
    assert doctest.testmod(performance, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_performance_record_replaces_its_own_section_only(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nintro\n")
    table = [("Steps", ["n", "|s|"], [[1, 0.25], [2, "a|b"]])]
    for day in ("2026-01-01", "2026-01-02"):
        performance.record("one", title="One", command="python one.py --record", tables=table, page=page,
                           machine="m", day=day)
    performance.record("two", title="Two", command="two --record", tables=[], page=page, machine="m", day="2026-01-03")
    text = page.read_text()
    assert text.count("<!-- one: begin -->") == 1 and "2026-01-01" not in text, text
    assert "Measured 2026-01-02 on m:" in text and "| 2 | a\\|b |" in text and "intro" in text, text
    assert "| n | \\|s\\| |" in text, text  # a header's | escaped too
    assert text.index("<!-- one: end -->") < text.index("<!-- two: begin -->"), text
    assert performance.record("x", title="X", command="x", tables=[], page=tmp_path / "absent.md") is None


def test_performance_page_holds_only_generated_sections():
    """Each section of docs/performance.md is a script's record (dated, on a machine, with its command) or a
    placeholder naming the command that records it; nothing else is measured there by hand."""
    text = (REPO / "docs" / "performance.md").read_text()
    sections = re.findall(r"<!-- (.+?): begin -->\n(.*?)<!-- \1: end -->", text, re.S)
    assert sections, "docs/performance.md has no sections"
    for name, body in sections:
        recorded = re.search(r"^Measured \d{4}-\d{2}-\d{2} on .+:\n\n    \S.*--record", body, re.M)
        awaiting = re.search(r"^Awaiting a run: `[^`]*--record`\.$", body, re.M)
        assert recorded or awaiting, f"section {name!r} of docs/performance.md is neither recorded nor awaiting a run"
    outside = re.sub(r"<!-- (.+?): begin -->\n.*?<!-- \1: end -->", "", text, flags=re.S)
    assert "|" not in outside, "a table outside the generated sections of docs/performance.md"
