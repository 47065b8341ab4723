"""Recipe runners: each reproduces one published result and writes ``report.md`` with PNG plots.

A recipe is a module here with ``run(cfg, out_dir) -> Report`` and a folder ``recipes/<name>/`` at the
top of the repository holding its ``config.yaml`` (a ``quick:`` section overrides it for ``--quick``)
and a README that opens with the exact command. ``lightning-par-recipe <name>`` runs it.
"""
RECIPES = ("parity", "pipeline_bubble", "memory", "communication", "scaling", "decision", "network",
           "fault_tolerance", "capacity")
