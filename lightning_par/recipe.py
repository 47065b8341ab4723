"""``lightning-par-recipe <name> [--quick] [key=value ...]``: run a recipe, write its report, print the path.

    lightning-par-recipe decision
    lightning-par-recipe scaling --quick
    lightning-par-recipe scaling trainer.accelerator=gpu devices=[1,2,4,8]
    lightning-par-recipe communication --record     # its tables also into docs/performance.md

The report (``report.md``, PNG plots, ``results.json``) goes to ``recipe-runs/<name>-<time>/`` under
the current directory (``--out`` to choose). ``key=value`` arguments override the recipe's
``config.yaml`` (OmegaConf dot-list syntax).
"""
from __future__ import annotations

import difflib
import importlib
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from lightning_par.cli_errors import ArgumentParser, UsageError, run_cli
from lightning_par.paths import recipes_dir
from lightning_par.recipes import RECIPES
from lightning_par.recipes.common import require_matplotlib

PROG = "lightning-par-recipe"


def load_config(name: str, quick: bool, overrides: list[str]):
    path = recipes_dir() / name / "config.yaml"
    cfg = OmegaConf.load(path)
    quick_cfg = cfg.pop("quick", None)
    if quick and quick_cfg is not None:
        for key, value in quick_cfg.items():  # each key replaced whole (a quick `models:` is the full list)
            cfg[key] = value
    OmegaConf.set_struct(cfg, True)  # an override of a key the recipe does not have fails, naming it
    for override in overrides:
        if "=" not in override:
            raise UsageError(f"`{override}` is neither a flag nor a key=value override of the recipe {name} "
                             f"(e.g. `trainer.max_steps=2`; see `{PROG} {name} --help`).")
    try:
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except ConfigKeyError as err:
        raise UsageError(_unknown_override(name, str(err.full_key or err.key), cfg)) from err
    except OmegaConfBaseException as err:
        raise UsageError(f"{str(err).splitlines()[0]} (in the override of the recipe {name}'s "
                         f"{err.full_key or 'config'}).") from err
    for override in overrides:  # the recipe's YAML is untyped: a number stays a number
        key = override.partition("=")[0]
        was, now = OmegaConf.select(cfg, key), OmegaConf.select(merged, key)
        kind = float if type(was) is float else type(was)
        if type(was) in (bool, int, float) and not (type(now) is kind or kind is float and type(now) is int):
            article = "an" if kind is int else "a"
            raise UsageError(f"`{override}`: the recipe {name} takes {article} {kind.__name__} there (its config "
                             f"has `{key}: {was}`).")
    return merged


def _unknown_override(name: str, key: str, cfg) -> str:
    """The message for an override of a key recipe ``name`` does not have: the keys it has that are nearest."""
    def leaves(node, prefix=""):
        for k, v in node.items():
            yield from leaves(v, f"{prefix}{k}.") if OmegaConf.is_dict(v) else [f"{prefix}{k}"]

    known = list(leaves(cfg))
    last = key.rpartition(".")[2]
    near = [k for k in known if k.rpartition(".")[2] == last] or difflib.get_close_matches(key, known, n=3)
    hint = f"did you mean {' or '.join(f'`{k}=`' for k in near)}?" if near else f"its keys: {', '.join(known)}."
    return (f"`{key}` is not a setting of the recipe {name} (recipes/{name}/config.yaml); {hint} "
            f"Fix the override or drop it.")


def run_recipe(argv: list[str] | None = None) -> Path:
    """Parse ``argv`` like the command line, run the recipe, write its report; return the report's path."""
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=RECIPES)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe's config.yaml")
    p.add_argument("--quick", action="store_true", help="the small version the smoke test runs")
    p.add_argument("--out", type=Path, default=None, help="run folder (default recipe-runs/<name>-<time>)")
    p.add_argument("--record", action="store_true",
                   help="also write the report's tables into the checkout's docs/performance.md")
    args = p.parse_intermixed_args(sys.argv[1:] if argv is None else argv)  # flags and overrides in any order
    cfg = load_config(args.name, args.quick, args.overrides)
    out = args.out or Path("recipe-runs") / f"{args.name}-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    require_matplotlib()  # every recipe draws its plots: say how to install it before any compute, not after
    module = importlib.import_module(f"lightning_par.recipes.{args.name}")
    flags = [*(["--quick"] if args.quick else []), *(["--record"] if args.record else [])]
    command = "lightning-par-recipe " + " ".join([args.name, *args.overrides, *flags])
    report = module.run(cfg, out, command)
    path = report.write(out)
    if args.record:  # [Note: a generated performance page] in lightning_par.performance
        from lightning_par import performance

        page = performance.record(f"recipe {args.name}", title=report.title, command=command, tables=report.tables,
                                  notes=report.notes)
        print(f"recorded in {page}" if page else "no docs/performance.md here (an installed package): not recorded")
    print(path.resolve())
    return path


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script (returns nothing: a returned value would become the exit status); a user's mistake
    is one message and exit 2 (``--debug``: the traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run_cli(PROG, lambda: run_recipe(argv), argv)


if __name__ == "__main__":
    main()
