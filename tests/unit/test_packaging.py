"""What the distribution promises: the tested torch range, matplotlib only for the recipes (with a message that
says how to install it when it is missing), the license file, ``py.typed`` shipped as package data."""
import sys
import tomllib
from pathlib import Path

import pytest

import lightning_par
from lightning_par.cli_errors import UsageError
from lightning_par.recipes.common import MatplotlibMissing, figure

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_dependencies_are_the_tested_range_and_matplotlib_is_an_extra():
    deps = PROJECT["project"]["dependencies"]
    assert "torch>=2.13,<2.15" in deps
    assert not [d for d in deps if d.startswith("matplotlib")]
    extras = PROJECT["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["recipes"])
    assert any(d.startswith("matplotlib") for d in extras["test"])


def test_license_and_type_marker_ship():
    assert PROJECT["project"]["license"] == {"text": "Apache-2.0"}
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    assert (Path(lightning_par.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["lightning_par"]


def test_plotting_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails as when it is missing
    with pytest.raises(MatplotlibMissing, match=r'^The recipes draw their plots with matplotlib, which is not '
                                                r'installed: pip install "lightning-par\[recipes\]"') as info:
        figure(4, 3)
    assert isinstance(info.value, UsageError) and isinstance(info.value, ModuleNotFoundError)
    assert info.value.name == "matplotlib"


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("folders, limit", [(("lightning_par", "tests", "benchmarks", "examples"), 450),
                                            (("lightning_par/strategies",), 350)])
def test_no_file_outgrows_its_limit(folders, limit):
    """The layout's rule: no file over 450 lines; the strategies are hook wiring, 350 lines a file at most, but for
    the one class that overrides every Lightning hook once (450, as any file)."""
    files = _python_files(*folders)
    assert len(files) > 10
    limits = {ROOT / "lightning_par/strategies/hybrid_parallel.py": 450}
    over = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > limits.get(p, limit)}
    assert not over, f"over {limit} lines: {over}"
