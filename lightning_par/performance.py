"""docs/performance.md, written by the scripts that measure: each recipe (``lightning-par-recipe NAME --record``) and
benchmark (``python benchmarks/NAME.py --record``) replaces its own section with its tables, the date, the machine
line and the command that regenerates it.

    >>> import tempfile, pathlib
    >>> page = pathlib.Path(tempfile.mkdtemp()) / "performance.md"
    >>> _ = page.write_text("# Performance\\n")
    >>> steps = ("Steps", ["n", "s"], [[1, 0.5]])
    >>> _ = record("demo", title="A demo", command="python demo.py --record", tables=[steps], page=page,
    ...            machine="a test machine", day="2026-01-01")
    >>> print(page.read_text())  # doctest: +NORMALIZE_WHITESPACE
    # Performance
    <!-- demo: begin -->
    ## A demo
    Measured 2026-01-01 on a test machine:
        python demo.py --record
    ### Steps
    | n | s |
    |---|---|
    | 1 | 0.5 |
    <!-- demo: end -->

[Note: a generated performance page]
A figure in the docs must be one that its command regenerates, never a hand-kept log. So the page is written only
by the scripts, through :func:`record`, each into a section between its two markers (a section not yet in the page
is appended), and a section says when, where and how it was measured. Recording is opt-in (``--record``): the
quick runs the tests make leave the page alone. An installed package (no ``docs/`` beside it) records nothing.
"""
from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Optional, Sequence

PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
Table = tuple[str, Sequence[str], Sequence[Sequence]]  # (caption, header, rows)


def machine() -> str:
    """The hardware line: devices, torch, Lightning and the OS."""
    import lightning.pytorch as pl
    import torch

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU only, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"
    return f"{device}; torch {torch.__version__}, lightning {pl.__version__}, {platform.system()}"


def cell(value) -> str:
    """A table cell: floats to 4 significant digits, ``|`` escaped."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return (["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def section(name: str, *, title: str, command: str, tables: Sequence[Table], notes: Sequence[str] = (),
            machine_line: str, day: str) -> str:
    begin, end = markers(name)
    lines = [begin, f"## {title}", "", f"Measured {day} on {machine_line}:", "", f"    {command}", ""]
    for caption, header, rows in tables:
        lines += [f"### {caption}", "", *markdown_table(header, rows), ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines).rstrip("\n") + "\n" + end


def record(name: str, *, title: str, command: str, tables: Sequence[Table], notes: Sequence[str] = (),
           page: Optional[Path] = None, machine: Optional[str] = None, day: Optional[str] = None) -> Optional[Path]:
    """Replace (or append) section ``name`` of the performance page; the page's path, or None where there is no
    page (an installed package). ``machine`` and ``day`` default to this machine's line and today (UTC)."""
    page = PAGE if page is None else Path(page)
    if not page.exists():
        return None
    text = page.read_text()
    block = section(name, title=title, command=command, tables=tables, notes=notes,
                    machine_line=machine or globals()["machine"](),
                    day=day or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    begin, end = markers(name)
    start, stop = text.find(begin), text.find(end)
    if start >= 0 and stop > start:
        text = text[:start] + block + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, page)
    return page
