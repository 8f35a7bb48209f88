"""One torch.compile row of the main job, run in a process of its own:

    python -m selective_ckpt.bench.compiled ROW CONFIG_JSON

Compiled graphs are shared by instances of a class and the activation_memory_budget is read when a
graph is compiled, so two budgets in one process measure the wrong thing (docs/DESIGN.md, Known
traps). The plain SDPA row is timed beside the compiled one here, interleaved, so the compiled
row's ratio to it is as fair as the in-process ratios; the main job prints that SDPA row too, and
the compiled row's "time vs sdpa" refers to it. Prints both rows' results as JSON, last line;
progress goes to stderr as tagged lines the main job's progress bar reads.
"""

import json
import sys

import torch._functorch.config

from ..memory.units import as_dtype
from .config import COMPILED_ROWS
from .runner import Progress, measure


def main(argv):
    row, spec = argv[0], json.loads(argv[1])
    if row not in COMPILED_ROWS:
        raise SystemExit(f"row must be one of {', '.join(COMPILED_ROWS)}, got {row!r}")
    cfg = dict(spec, dtype=as_dtype(spec["dtype"]))
    budget = spec.get("compile_budget", COMPILED_ROWS[row]) if COMPILED_ROWS[row] is not None else None
    if budget is not None:
        torch._functorch.config.activation_memory_budget = budget
    results = measure(cfg, ["sdpa", row], Progress(0, True, relay=True))
    for r in results:
        r["process"] = row
        if r["row"] == row:
            r["activation_memory_budget"] = budget
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
