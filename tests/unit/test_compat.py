"""Private torch and Lightning APIs are imported in lightning_par/_compat.py and nowhere else in the package:
a torch or Lightning release that moves one then breaks that file only, with the name at hand."""
import ast
from pathlib import Path

import pytest

import lightning_par

PACKAGE = Path(lightning_par.__file__).parent


def _private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def _private_imports(path: Path) -> list[str]:
    """``module`` / ``module:name`` of every import of a private module or name of another package in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _private(a.name) and not a.name.startswith("lightning_par")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and not node.module.startswith("lightning_par"):
            if _private(node.module):
                found.append(node.module)
            found += [f"{node.module}:{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_private_apis_are_imported_in_compat_only():
    offenders = {str(p.relative_to(PACKAGE)): _private_imports(p) for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "_compat.py"}
    offenders = {p: names for p, names in offenders.items() if names}
    assert not offenders, f"private imports outside lightning_par/_compat.py: {offenders}"


def test_the_grep_sees_a_private_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from torch.utils._pytree import tree_map\nfrom lightning.fabric.utilities import _x as y\n"
                 "import torch._C\nfrom lightning_par._compat import tree_map\n")
    assert _private_imports(f) == ["torch.utils._pytree", "lightning.fabric.utilities:_x", "torch._C"]


def test_a_patch_is_recorded_only_under_a_listed_name_and_undone_newest_first():
    from lightning_par import patches

    undone = []
    patches.record("dtensor-rules", lambda: undone.append(1))
    patches.record("module-log", lambda: undone.append(2))
    patches.record("dtensor-rules", lambda: undone.append(3))
    try:
        with pytest.raises(ValueError, match="'unlisted' is not listed in lightning_par.patches.PATCHES"):
            patches.record("unlisted", lambda: None)
        patches.undo("dtensor-rules")
        assert undone == [3, 1] and patches.pending() == ["module-log"]
    finally:
        patches.undo()
    assert undone == [3, 1, 2] and patches.pending() == []
