"""Private torch and Lightning APIs are imported in lightning_par/_compat/ and nowhere else in the package:
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
                 if "_compat" not in p.relative_to(PACKAGE).parts}
    offenders = {p: names for p, names in offenders.items() if names}
    assert not offenders, f"private imports outside lightning_par/_compat/: {offenders}"


def test_the_grep_sees_a_private_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from torch.utils._pytree import tree_map\nfrom lightning.fabric.utilities import _x as y\n"
                 "import torch._C\nfrom lightning_par._compat import tree_map\n")
    assert _private_imports(f) == ["torch.utils._pytree", "lightning.fabric.utilities:_x", "torch._C"]


# -- private attributes of objects we do not own ------------------------------------------------------------------
# ``X._name`` where X is not ``self`` / ``cls`` / ``super()`` and no code of ours defines ``_name`` (as a function,
# class or module-level name, or as ``self._name = ...``) reads or writes a torch / Lightning object's internals:
# that belongs in _compat.py, as a named function. The exceptions, each with its reason:
ALLOWED_ATTRIBUTES = {
    # nn.Module's slots for parameters, buffers and children: the materializer and the pipeline's ghost copies put
    # meta / DTensor tensors there and read them without recursion, as torch's own ``_apply`` and ``to_empty`` do
    "_parameters", "_buffers", "_modules",
    "_exit",  # os._exit: public API of the os module (a worker that must not run atexit handlers)
    "_replace", "_fields", "_asdict",  # namedtuple's public API
}


def _foreign_names() -> set[str]:
    """The private names of the torch, Lightning and transformers objects our code handles: a method of ours of the
    same name (an override, as ``ParallelStyle._apply``) does not make another object's attribute ours."""
    import lightning.pytorch as pl
    import torch
    import transformers
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    classes = [torch.nn.Module, torch.Tensor, DTensor, ParallelStyle, torch.optim.Optimizer,
               torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.SequentialLR, pl.LightningModule,
               pl.Trainer, DDPStrategy, transformers.PreTrainedModel, transformers.PretrainedConfig]
    return {n for c in classes for n in dir(c) if n.startswith("_") and not n.startswith("__")}


def _own_names() -> set[str]:
    """Every private name our package defines (functions, classes, module-level names, ``self._x = ...``) that
    no foreign object it handles has too."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                own.add(node.attr)
    return {n for n in own if n.startswith("_")} - _foreign_names()


def _is_self(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _private_attributes(path: Path, own: set[str]) -> list[str]:
    """``line: expression`` of every access to another object's private attribute in ``path`` that is neither
    ours nor in :data:`ALLOWED_ATTRIBUTES`: ``x._name``, and ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr``
    of ``x`` with the name as a string (in either quotes)."""
    def private(name) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name not in own \
            and name not in ALLOWED_ATTRIBUTES

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and private(node.attr) and not _is_self(node.value):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and private(node.args[1].value)
              and not _is_self(node.args[0])):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_attributes_of_foreign_objects_are_read_in_compat_only():
    own = _own_names()
    offenders = {str(p.relative_to(PACKAGE)): _private_attributes(p, own) for p in sorted(PACKAGE.rglob("*.py"))
                 if "_compat" not in p.relative_to(PACKAGE).parts}
    offenders = {p: found for p, found in offenders.items() if found}
    assert not offenders, f"private attributes of torch / Lightning objects outside lightning_par/_compat/ " \
                          f"(add a named function there): {offenders}"


def test_the_check_sees_a_private_attribute(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("connector = trainer._accelerator_connector\nself._mine = 1\nsuper()._apply(f)\n"
                 "x = module._parameters\nstrategy._mine\ntorch._C._foo()\n"
                 "getattr(t, '_local_tensor', t)\ngetattr(opt, \"_optimizer\")\nsetattr(m, '_x', 1)\n"
                 "hasattr(m, \"_mine\")\ngetattr(self, '_y', None)\ngetattr(m, '__dict__')\n")
    assert sorted(_private_attributes(f, {"_mine"})) == [
        "1: trainer._accelerator_connector", "6: torch._C", "6: torch._C._foo", "7: getattr(t, '_local_tensor', t)",
        "8: getattr(opt, '_optimizer')", "9: setattr(m, '_x', 1)"]


def test_a_method_of_ours_with_a_foreign_name_is_not_ours():
    """``module._apply`` is nn.Module's even though tensor/transposed.py overrides ParallelStyle's ``_apply``."""
    own = _own_names()
    assert "_apply" not in own and "_init_weights" not in own and "_local_tensor" not in own


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
