"""``lightning-par-recipe <name> [--quick] [key=value ...]``: run a recipe, write its report, print the path.

    lightning-par-recipe decision
    lightning-par-recipe scaling --quick
    lightning-par-recipe scaling trainer.accelerator=gpu devices=[1,2,4,8]

The report (``report.md``, PNG plots, ``results.json``) goes to ``recipe-runs/<name>-<time>/`` under
the current directory (``--out`` to choose). ``key=value`` arguments override the recipe's
``config.yaml`` (OmegaConf dot-list syntax).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from lightning_par.paths import recipes_dir
from lightning_par.recipes import RECIPES


def load_config(name: str, quick: bool, overrides: list[str]):
    path = recipes_dir() / name / "config.yaml"
    cfg = OmegaConf.load(path)
    quick_cfg = cfg.pop("quick", None)
    if quick and quick_cfg is not None:
        for key, value in quick_cfg.items():  # each key replaced whole (a quick `models:` is the full list)
            cfg[key] = value
    OmegaConf.set_struct(cfg, True)  # an override of a key the recipe does not have fails, naming it
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    return cfg


def run_recipe(argv: list[str] | None = None) -> Path:
    """Parse ``argv`` like the command line, run the recipe, write its report; return the report's path."""
    p = argparse.ArgumentParser(prog="lightning-par-recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=RECIPES)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe's config.yaml")
    p.add_argument("--quick", action="store_true", help="the small version the smoke test runs")
    p.add_argument("--out", type=Path, default=None, help="run folder (default recipe-runs/<name>-<time>)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.name, args.quick, args.overrides)
    out = args.out or Path("recipe-runs") / f"{args.name}-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(f"lightning_par.recipes.{args.name}")
    command = "lightning-par-recipe " + " ".join([args.name, *args.overrides, *(["--quick"] if args.quick else [])])
    report = module.run(cfg, out, command)
    path = report.write(out)
    print(path.resolve())
    return path


def main(argv: list[str] | None = None) -> None:
    """The console script (returns nothing: a returned value would become the exit status)."""
    run_recipe(argv)


if __name__ == "__main__":
    main()
