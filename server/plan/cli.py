"""`pdserve plan`: profile this machine's tiers, simulate a cluster, size the cheapest plans, validate.

    pdserve plan profile  [--out profile.json]        measure the tiers through the served engines
    pdserve plan simulate --profile P [bench's flags] one cluster on one workload (--json: bench's keys)
    pdserve plan size     --profile P [bench's flags] cheapest plans meeting SLOs; a kustomize overlay
    pdserve plan validate --profile P                 the simulator against `pdserve bench` on a real 1P+1D
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"profile": None, "simulate": "simulate_cli", "size": "size", "validate": None}
"""Each command's module here; None: a command that drives a live cluster with the benchmarks' load
generator, found under MEASURING (benchmarks/plan/: `measure.py`, `validate.py`)."""
MEASURING = "pdserve.plan.commands"
"""The entry-point group (pyproject.toml) of the commands that measure: the server never imports the
benchmarks, which ship in the wheel beside it and register them there."""


def _command(name: str):
    """The command's `main(argv) -> int`."""
    if COMMANDS[name] is not None:
        return importlib.import_module(f"pdserve.server.plan.{COMMANDS[name]}").main
    from importlib.metadata import entry_points

    found = entry_points(group=MEASURING, name=name)
    if not found:
        raise SystemExit(f"pdserve plan {name}: this install registers no {MEASURING!r} entry point {name!r} "
                         f"(pyproject.toml); install pdserve again (`pip install -e .` in a checkout)")
    return next(iter(found)).load()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"pdserve plan: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    command = _command(argv[0])
    try:
        return command(argv[1:])
    except ValueError as e:
        print(f"pdserve plan {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
