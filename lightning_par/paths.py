"""Where the app's ``conf/`` and ``recipes/`` folders are, in a source checkout and after ``pip install .``.

[Note: top-level conf/ and recipes/]
Both folders live at the top of the repository, next to ``lightning_par/``, where users read and edit
them. A non-editable install copies them into the package as ``lightning_par/_conf`` and
``lightning_par/_recipes`` (``setup.py``'s ``build_py``). The resolver prefers the checkout's
top-level folder when the package is imported from a checkout (an edit there takes effect at once)
and falls back to the installed copy otherwise.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(name: str, marker: str | None) -> Path:
    candidates = (_PACKAGE.parent / name, _PACKAGE / f"_{name}")
    for folder in candidates:
        if folder.is_dir() and (marker is None or (folder / marker).is_file()):
            return folder
    raise FileNotFoundError(
        f"lightning_par cannot find its `{name}/` folder; looked in {', '.join(map(str, candidates))}. "
        f"Run from a checkout of the repository or reinstall the package (`pip install .`)."
    )


def conf_dir() -> Path:
    """The folder holding ``config.yaml`` and the config groups of ``lightning-par-train``."""
    return _locate("conf", "config.yaml")


def recipes_dir() -> Path:
    """The folder holding the recipes (one per published result)."""
    return _locate("recipes", None)
