"""Build hook: ship the top-level ``conf/`` and ``recipes/`` inside the package (see lightning_par/paths.py).

Everything else about the distribution is in pyproject.toml.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"conf": "_conf", "recipes": "_recipes"}  # top-level folder -> package folder


class BuildPyWithConfigs(build_py):
    """Copies ``conf/`` and ``recipes/`` to ``lightning_par/_conf`` and ``lightning_par/_recipes`` in the build."""

    def run(self):
        super().run()
        for source, target in SHIPPED.items():
            src = ROOT / source
            if not src.is_dir():
                continue
            dst = Path(self.build_lib) / "lightning_par" / target
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "outputs", "*.ckpt"))


setup(cmdclass={"build_py": BuildPyWithConfigs})
